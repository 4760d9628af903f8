"""The options each stage takes, built from the one :class:`ServeConfig`.

Stages do not see the whole config: trust gets :class:`VerifyOptions`, the source
resolver :class:`SourceOptions`, the side socket :class:`LocalConfig`. They are made
here and nowhere else, so a setting reaches its stage by exactly one path.
"""

from __future__ import annotations

import os

from ..adapters.autoload import AutoloadPolicy
from ..sources.bounds import StoreBounds
from ..sources.download import DownloadSettings
from ..sources.resolver import SourceOptions
from ..sources.s3 import S3Settings
from ..transports.options import LocalConfig, PrebuildOptions
from ..trust.verify import VerifyOptions
from .schema import ServeConfig


def default_cache_dir(env: dict[str, str] | None = None) -> str:
    """``$XDG_CACHE_HOME/weightd``, else ``~/.cache/weightd``."""
    env = env if env is not None else {}
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "weightd")


def verify_options(config: ServeConfig) -> VerifyOptions:
    """How models are verified (loads and reloads alike)."""
    trust = config.trust
    hashes = os.path.join(config.cache_dir, "hashes") if config.cache_dir else None
    return VerifyOptions(
        manifests=config.manifests(),
        trust_keys=trust.trust_key,
        trust_hf_cache=trust.trust_hf_cache,
        hash_cache_dir=hashes if trust.hash_cache else None,
        reverify=trust.reverify,
        threads=trust.hash_threads,
    )


def local_config(config: ServeConfig) -> LocalConfig:
    """The same-host transports."""
    local = config.local
    return LocalConfig(
        enabled=local.shm,
        host_budget_bytes=local.shm_budget_bytes,
        ttl_seconds=local.pack_ttl,
        pin=local.pin,
        pin_budget_bytes=local.pin_budget_bytes,
        cuda_ipc=local.cuda_ipc,
        cuda_budget_bytes=local.cuda_budget_bytes,
        max_connections=local.side_max_connections,
        max_connections_per_user=local.side_max_connections_per_user,
        request_seconds=local.side_request_seconds,
    )


def source_options(config: ServeConfig) -> SourceOptions:
    """Remote (``s3://``) sources: the store, the download engine, the cache."""
    s3 = config.s3
    return SourceOptions(
        s3=S3Settings(
            endpoint=s3.endpoint,
            region=s3.region,
            max_attempts=s3.max_attempts,
            pool_connections=s3.concurrency + 2,
            bounds=StoreBounds(
                min_bytes_per_second=s3.min_bytes_per_second,
                rate_grace_seconds=s3.rate_grace_seconds,
                request_seconds=s3.request_seconds,
                list_seconds=s3.list_seconds,
            ),
        ),
        download=DownloadSettings(
            part_bytes=s3.part_bytes,
            concurrency=s3.concurrency,
            read_chunk=min(1 << 20, s3.part_bytes),
            max_bytes_per_second=s3.max_bytes_per_second,
        ),
        cache_dir=os.path.join(config.cache_dir, "sources") if config.cache_dir else "",
        trust_object_store=config.trust.trust_object_store,
    )


def autoload_policy(config: ServeConfig) -> AutoloadPolicy:
    """Which adapters a worker may have loaded on request, and what vouches for them."""
    adapters = config.adapters
    return AutoloadPolicy(
        allow=adapters.autoload,
        digests=adapters.digests(),
        trust_roots=adapters.autoload_trust_roots,
    )


def prebuild_options(config: ServeConfig) -> PrebuildOptions:
    """Declared layouts: which packs each model's load builds, and what then happens."""
    local = config.local
    return PrebuildOptions(
        declared=config.layout,
        remember=local.remember_layouts and bool(config.cache_dir),
        max_remembered=local.max_remembered_layouts,
        drop_shard_pages=local.drop_shard_pages,
        threads=local.pack_build_threads or None,
    )


def layouts_dir(config: ServeConfig) -> str | None:
    """Where remembered layouts live (None: not remembered)."""
    if not (config.local.remember_layouts and config.cache_dir):
        return None
    return os.path.join(config.cache_dir, "layouts")
