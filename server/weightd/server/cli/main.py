"""The ``weightd`` command line. Failures print one line, never a traceback.

This file registers every command, dispatches, and runs the local ones (``serve``,
``plan``, ``demo-checkpoint``); the commands that are clients of a running daemon
are in ``client_commands``, the trust commands in ``trust_commands``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from weightd.common.sockets import default_socket_path

from ..base.errors import WeightdError
from ..transports.options import add_arguments as add_local_arguments
from .client_commands import (
    add_fetch_parser,
    run_describe,
    run_fetch,
    run_health,
    run_list,
    run_reload,
)
from .client_commands import add_parsers as add_client_parsers
from .source_options import add_arguments as add_source_arguments
from .trust_commands import add_parsers as add_trust_parsers
from .trust_commands import add_serve_options, run_manifest, run_verify, serve_verify_options

log = logging.getLogger("weightd")


def _model_arg(text: str) -> tuple[str | None, str]:
    name, sep, directory = text.partition("=")
    if sep and name and "/" not in name:
        return name, directory
    return None, text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightd", description="Serve verified per-rank slices of model checkpoints."
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument(
        "--model",
        action="append",
        type=_model_arg,
        metavar="[NAME=]DIR|s3://BUCKET/PREFIX/",
        help="checkpoint directory, or an s3:// prefix holding one, to serve (repeatable); "
        "default: the built-in demo checkpoint",
    )
    s.add_argument(
        "--listen",
        default=None,
        help="gRPC address: unix:///PATH.sock or HOST:PORT "
        f"(default: unix://{default_socket_path()})",
    )
    s.add_argument(
        "--socket-group-access",
        action="store_true",
        help="worker and side sockets 0660 in a 0750 directory, so members of the daemon's "
        "group may connect (default: 0600 in 0700, this user only; admin stays 0600)",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow TCP without TLS (logged loudly; off loopback, weights cross the network "
        "in clear)",
    )
    s.add_argument("--chunk-bytes", type=int, default=1 << 20, help="tensor bytes per message")
    s.add_argument(
        "--fetch-rehash",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="hash each slice again as every Fetch sends it and compare with the anchored "
        "digest; by default (--no-fetch-rehash) only a Fetch that asks is re-hashed (a "
        "client asks after its own digest check failed), the others rely on the shard "
        "descriptors' fstat and the client's own check (docs/grpc-throughput.md)",
    )
    s.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        dest="adapter_roots",
        metavar="DIR|s3://BUCKET/PREFIX/",
        help="a directory (or s3:// prefix) LoRA adapters may be loaded from (repeatable); "
        "none: no loads",
    )
    s.add_argument(
        "--adapter-budget-bytes",
        type=int,
        default=None,
        help="bytes of adapters held at once; unleased, unpinned ones are evicted LRU",
    )
    s.add_argument(
        "--watch-interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="check every served shard file this often: a changed one is reported, a "
        "chmod re-verified, a good file renamed into place restored (0: off)",
    )
    s.add_argument("--max-workers", type=int, default=16, help="RPC worker threads")
    s.add_argument(
        "--max-concurrent-rpcs", type=int, default=64, help="beyond this, RESOURCE_EXHAUSTED"
    )
    s.add_argument("--grace", type=float, default=30.0, help="seconds to drain after SIGTERM")
    s.add_argument(
        "--cache-dir",
        default=None,
        help="where the demo checkpoint, the hash cache and downloaded s3:// sources live",
    )
    s.add_argument(
        "--rules",
        action="append",
        default=[],
        metavar="FILE",
        help="sharding rules table (JSON) for an architecture (repeatable; before built-ins)",
    )
    s.add_argument("--log-level", default="INFO")
    _add_ops_args(s)
    add_serve_options(s)
    add_local_arguments(s)
    add_source_arguments(s)

    add_fetch_parser(sub)

    pl = sub.add_parser("plan", help="show each worker's share of a checkpoint under a layout")
    pl.add_argument("directory", help="checkpoint directory (only headers are read)")
    pl.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    pl.add_argument("--pp", type=int, default=1, help="pipeline stages")
    pl.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    pl.add_argument(
        "--pp-layers",
        type=_counts,
        default=(),
        metavar="N,N,...",
        help="decoder layers per stage (default: vLLM's even split)",
    )
    pl.add_argument(
        "--vocab-pad",
        type=int,
        default=0,
        metavar="N",
        help="cut vocabulary-parallel tensors as vLLM pads them to a multiple of N "
        "(vLLM: 64); default 0: equal blocks",
    )
    pl.add_argument("--rules", action="append", default=[], metavar="FILE")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--tensors", action="store_true", help="list every rank's tensors")

    add_client_parsers(sub)

    demo = sub.add_parser(
        "demo-checkpoint", help="create (if needed) and print the demo checkpoint"
    )
    demo.add_argument("--cache-dir", default=None)
    add_trust_parsers(sub)
    return p


def _add_ops_args(s: argparse.ArgumentParser) -> None:
    """``serve`` flags for operations: TLS, admin, metrics, health, reflection, logs, bounds."""
    s.add_argument("--tls-cert", default=None, help="PEM certificate chain for TCP listeners")
    s.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    s.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle: require client certificates signed by it (mutual TLS)",
    )
    s.add_argument(
        "--admin-listen",
        default=None,
        help="admin RPC address: unix:///PATH.sock, HOST:PORT (mutual TLS + --admin-allow), "
        "or 'none' (default: admin.sock next to the worker socket)",
    )
    s.add_argument(
        "--admin-allow",
        action="append",
        default=[],
        metavar="IDENTITY",
        help="client certificate CN/SAN allowed to call admin RPCs over TCP (repeatable)",
    )
    s.add_argument(
        "--metrics-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP here (host defaults to 127.0.0.1; port 0 "
        "picks one, logged)",
    )
    s.add_argument(
        "--health-listen",
        default=None,
        metavar="HOST:PORT",
        help="plaintext gRPC listener with only grpc.health.v1 (Kubernetes gRPC probes)",
    )
    s.add_argument("--reflection", action="store_true", help="serve gRPC server reflection")
    s.add_argument("--log-json", action="store_true", help="log JSON lines")
    s.add_argument(
        "--max-stream-seconds",
        type=float,
        default=3600.0,
        help="end any server stream (Fetch, FetchAdapter, watches) running longer than this, "
        "whatever the client's deadline (0: no cap)",
    )
    s.add_argument(
        "--stream-idle-seconds",
        type=float,
        default=60.0,
        help="cancel a server stream whose client has taken no message for this long (0: off)",
    )


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _plan(args: argparse.Namespace) -> int:
    from ..plan.report import run_plan

    print(
        run_plan(
            args.directory,
            args.tp,
            args.pp,
            args.ep,
            args.pp_layers,
            args.rules,
            json_out=args.json,
            tensors=args.tensors,
            vocab_pad=args.vocab_pad,
        )
    )
    return 0


def _cache_dir(arg: str | None) -> str:
    from .demo import default_cache_dir

    return arg or default_cache_dir(dict(os.environ))


def _serve(args: argparse.Namespace) -> int:
    from ..daemon.assembly import ServeConfig, serve
    from ..sources.location import default_model_name, is_remote, parse_s3_uri
    from ..transports.options import from_arguments
    from .demo import DEMO_NAME, ensure_demo_checkpoint
    from .preflight import check_serve
    from .source_options import from_arguments as source_options

    models: list[tuple[str | None, str]] = args.model or []
    for _, source in [*models, *((None, r) for r in args.adapter_roots)]:
        if is_remote(source):
            parse_s3_uri(source)  # a malformed location fails here, in one line
    names = [name or default_model_name(d) for name, d in models] or [DEMO_NAME]
    verify = serve_verify_options(args, names, _cache_dir(args.cache_dir))
    config = ServeConfig(
        models=models,
        listen=args.listen or f"unix://{default_socket_path()}",
        insecure=args.insecure,
        socket_group_access=args.socket_group_access,
        max_workers=args.max_workers,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        chunk_bytes=args.chunk_bytes,
        fetch_rehash=args.fetch_rehash,
        grace_seconds=args.grace,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        admin_listen=args.admin_listen,
        admin_allow=args.admin_allow,
        metrics_listen=args.metrics_listen,
        health_listen=args.health_listen,
        reflection=args.reflection,
        max_stream_seconds=args.max_stream_seconds,
        stream_idle_seconds=args.stream_idle_seconds,
        rules_files=args.rules,
        verify=verify,
        local=from_arguments(args),
        adapter_roots=args.adapter_roots,
        watch_seconds=args.watch_interval,
        adapter_budget_bytes=args.adapter_budget_bytes,
        sources=source_options(args, _cache_dir(args.cache_dir)),
    )
    # Everything named on the command line is checked before a socket is bound or a
    # line logged: a typo is one line, and leaves no socket directory behind.
    check_serve(config, names)
    if not models:
        path = ensure_demo_checkpoint(_cache_dir(args.cache_dir))
        log.info("no --model given: serving the built-in demo checkpoint at %s", path)
        config.models = [(DEMO_NAME, path)]
    return serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..telemetry.logs import setup_logging

    setup_logging(getattr(args, "log_level", "INFO"), json_lines=getattr(args, "log_json", False))
    # Only the client commands import the client (and fetch torch, to make tensors):
    # verify, manifest, serve, list and describe start seconds faster without it.
    explained: tuple[type[Exception], ...] = (WeightdError,)
    if args.command in ("fetch", "list", "describe", "reload"):
        from weightd.client.errors import WeightdError as ClientError

        explained = (WeightdError, ClientError)

    try:
        status = _dispatch(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe cannot be caught
        return status
    except BrokenPipeError:
        return _output_closed()
    except explained as exc:
        print(f"weightd {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"weightd {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(args)
    if args.command == "fetch":
        return run_fetch(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "list":
        return run_list(args)
    if args.command == "describe":
        return run_describe(args)
    if args.command == "health":
        return run_health(args)
    if args.command == "reload":
        return run_reload(args)
    if args.command == "verify":
        return run_verify(args)
    if args.command == "manifest":
        return run_manifest(args)
    print(_demo_path(args))
    return 0


def _output_closed() -> int:
    """Whoever read our output stopped (``weightd describe ... | head``): exit quietly.

    What is still buffered can never be written; stdout is pointed at /dev/null so the
    interpreter's final flush does not print a second complaint. The status is a shell's
    for a process ended by SIGPIPE, so ``set -o pipefail`` still sees the cut.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _demo_path(args: argparse.Namespace) -> str:
    from .demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint(_cache_dir(args.cache_dir))


if __name__ == "__main__":
    sys.exit(main())
