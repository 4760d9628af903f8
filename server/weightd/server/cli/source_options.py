"""``weightd serve``'s flags for remote (``s3://``) models and adapters.

Credentials are not flags: boto3's standard chain finds them (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared
config files, web identity tokens, container and instance roles), so a secret never
appears in a command line, a process listing or a log.
"""

from __future__ import annotations

import argparse
import os

from ..base.errors import UsageError
from ..sources.download import DownloadSettings
from ..sources.resolver import SourceOptions
from ..sources.s3 import S3Settings


def add_arguments(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("remote sources (--model NAME=s3://bucket/prefix/)")
    g.add_argument(
        "--s3-endpoint",
        default=None,
        metavar="URL",
        help="S3-compatible endpoint (SeaweedFS, MinIO, Ceph RGW); default: AWS",
    )
    g.add_argument("--s3-region", default=None, help="region (default: the AWS configuration's)")
    g.add_argument(
        "--s3-concurrency", type=int, default=8, help="ranged GETs in flight per download"
    )
    g.add_argument(
        "--s3-part-bytes",
        type=int,
        default=16 << 20,
        help="bytes per ranged GET; a crash costs at most this much per GET in flight again",
    )
    g.add_argument(
        "--s3-max-bytes-per-second",
        type=int,
        default=None,
        help="cap the download rate (all GETs together), to leave the node's network to others",
    )
    g.add_argument(
        "--s3-max-attempts",
        type=int,
        default=5,
        help="attempts per request, retries with the SDK's backoff included (throttling, "
        "dropped connections)",
    )
    g.add_argument(
        "--trust-object-store",
        action="store_true",
        help="serve s3:// models without a --manifest (and s3:// adapters without an "
        "expected digest): whoever can write the bucket then decides what is served",
    )


def from_arguments(args: argparse.Namespace, cache_dir: str) -> SourceOptions:
    if args.s3_concurrency < 1 or args.s3_concurrency > 256:
        raise UsageError("--s3-concurrency must be between 1 and 256")
    if args.s3_part_bytes < (64 << 10) or args.s3_part_bytes > (5 << 30):
        raise UsageError("--s3-part-bytes must be between 64 KiB and 5 GiB")
    if args.s3_max_attempts < 1:
        raise UsageError("--s3-max-attempts must be at least 1")
    rate = args.s3_max_bytes_per_second
    if rate is not None and rate < 1:
        raise UsageError("--s3-max-bytes-per-second must be positive")
    return SourceOptions(
        s3=S3Settings(
            endpoint=args.s3_endpoint,
            region=args.s3_region,
            max_attempts=args.s3_max_attempts,
            pool_connections=args.s3_concurrency + 2,
        ),
        download=DownloadSettings(
            part_bytes=args.s3_part_bytes,
            concurrency=args.s3_concurrency,
            read_chunk=min(1 << 20, args.s3_part_bytes),
            max_bytes_per_second=rate,
        ),
        cache_dir=os.path.join(cache_dir, "sources"),
        trust_object_store=args.trust_object_store,
    )
