"""The daemon's Prometheus instruments, on a registry the caller injects.

Why injected: tests build their own :class:`~prometheus_client.CollectorRegistry`
and read values with ``get_sample_value``; the daemon never touches the global
default registry, so two daemons in one process (tests) never collide.

Conventions (checked by ``promtool check metrics`` on a real scrape): a ``weightd_``
prefix, base units (``_bytes``, ``_seconds``), counters ending in ``_total``, and
only bounded label values: model names come from the operator's ``--model`` flags,
methods and codes from the proto and gRPC's fixed set, never from a client string.

What is measured where: RPC counts, latency, bytes served and active streams come
from the server interceptor (:class:`~weightd.server.rpc.interceptors.RpcObserver`);
memory (file mappings, page cache residency, GPU) is computed on scrape by
:mod:`weightd.server.daemon.collectors`, off the hot path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from ..base import errors
from .httpserver import MetricsHttpServer

log = logging.getLogger("weightd.metrics")

#: Fetch streams take from milliseconds (a few small tensors) to minutes (a whole
#: 70B rank over a slow link).
FETCH_BUCKETS: Final = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Verification reads and hashes every byte once: seconds to tens of minutes.
VERIFY_BUCKETS: Final = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

#: Failure reasons, most specific class first (pure table; see :func:`failure_reason`).
_REASONS: Final[tuple[tuple[type[BaseException], str], ...]] = (
    (errors.HeaderError, "header"),
    (errors.IndexFileError, "index"),
    (errors.ConfigError, "config"),
    (errors.UnsafePathError, "unsafe_path"),
    (errors.CheckpointError, "checkpoint"),
    (errors.DataIntegrityError, "digest_mismatch"),
    (errors.NoShardingRules, "sharding_rules"),
    (errors.ShardingError, "sharding_rules"),
    (errors.WeightdError, "other"),
    (OSError, "io"),
)

#: Every value :func:`failure_reason` can return: the label's whole domain.
FAILURE_REASONS: Final = frozenset({r for _, r in _REASONS} | {"internal"})


def failure_reason(error: BaseException) -> str:
    """A bounded label for why a model failed verification (pure)."""
    for cls, reason in _REASONS:
        if isinstance(error, cls):
            return reason
    return "internal"


@dataclass
class Metrics:
    """The instruments the daemon updates as things happen (everything else is on scrape)."""

    registry: CollectorRegistry
    rpcs: Counter
    active_streams: Gauge
    fetch_seconds: Histogram
    served_bytes: Counter
    verify_seconds: Histogram
    verify_failures: Counter
    reloads: Counter
    scrape_errors: Counter
    fetch_resumes: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, *, version: str = "") -> Metrics:
        """Register the instruments, the standard process collectors and build info."""
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, open fds, CPU...
        PlatformCollector(registry=registry)  # python_info
        GCCollector(registry=registry)
        registry.register(_BuildInfo(version))
        return cls(
            registry=registry,
            rpcs=Counter(
                "weightd_rpcs",
                "RPCs handled, by service, method and final status code.",
                ["service", "method", "code"],
                registry=registry,
            ),
            active_streams=Gauge(
                "weightd_active_streams",
                "Server-streaming RPCs in flight (Fetch, health Watch), by method.",
                ["service", "method"],
                registry=registry,
            ),
            fetch_seconds=Histogram(
                "weightd_fetch_duration_seconds",
                "Duration of fetches that completed OK, by transport (grpc: the Fetch stream; "
                "shm, cuda_ipc: from the side channel's request to its grant, pack built).",
                ["transport"],
                buckets=FETCH_BUCKETS,
                registry=registry,
            ),
            served_bytes=Counter(
                "weightd_served_bytes",
                "Tensor payload bytes sent to workers, by transport (grpc, shm, cuda_ipc: the "
                "granted slices' bytes) and model.",
                ["transport", "model"],
                registry=registry,
            ),
            verify_seconds=Histogram(
                "weightd_verification_duration_seconds",
                "Time to read, check and hash a model (load or reload) that passed.",
                ["model"],
                buckets=VERIFY_BUCKETS,
                registry=registry,
            ),
            verify_failures=Counter(
                "weightd_verification_failures",
                "Model loads or reloads that failed verification, by model and reason.",
                ["model", "reason"],
                registry=registry,
            ),
            reloads=Counter(
                "weightd_reloads",
                "Admin reloads, by model and outcome (ok, failed).",
                ["model", "outcome"],
                registry=registry,
            ),
            scrape_errors=Counter(
                "weightd_scrape_errors",
                "Errors while computing a metric on scrape (the series is skipped), by collector.",
                ["collector"],
                registry=registry,
            ),
            fetch_resumes=Counter(
                "weightd_fetch_resumes",
                "Fetch streams asking to resume an interrupted fetch, by model and outcome "
                "(resumed; refused: the content changed, the client starts again from 0).",
                ["model", "outcome"],
                registry=registry,
            ),
        )

    def model_known(self, model: str) -> None:
        """Create the per-model series at zero once the operator's model is known, so
        rates and alerts work from the first scrape rather than from the first event."""
        self.served_bytes.labels("grpc", model)
        self.served_bytes.labels("shm", model)
        self.reloads.labels(model, "ok")
        self.reloads.labels(model, "failed")


class _BuildInfo:
    """``weightd_build_info{version} 1``: lets dashboards tell versions apart."""

    def __init__(self, version: str) -> None:
        self.version = version

    def collect(self) -> list[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "weightd_build_info", "weightd version; always 1.", labels=["version"]
        )
        g.add_metric([self.version], 1)
        return [g]

    def describe(self) -> list[GaugeMetricFamily]:
        return self.collect()


@dataclass
class MetricsServer:
    """The HTTP listener Prometheus scrapes (``/metrics``); separate from gRPC on purpose:
    scrapers need no gRPC, TLS or socket permissions, and a scrape never competes with
    a Fetch for an RPC thread. Bounded in threads, connections and time
    (:mod:`.httpserver`)."""

    server: MetricsHttpServer
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.server.close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Start the metrics listener on ``host:port`` (port 0 picks a free one)."""
    try:
        server = MetricsHttpServer(registry, host, port)
    except OSError as exc:
        raise errors.ListenError(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}"
        ) from None
    return MetricsServer(server, host, server.port)


#: Downloads from object storage take seconds to hours (a 400 GB model over 1 Gb/s).
DOWNLOAD_BUCKETS: Final = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)

#: Why a download from a remote source failed (pure table, most specific first; the
#: errors come from base.errors, so the table is written against those classes).
_SOURCE_REASONS: Final[tuple[tuple[type[BaseException], str], ...]] = (
    (errors.ObjectNotFound, "not_found"),
    (errors.ObjectAccessDenied, "access_denied"),
    (errors.ObjectStoreTooSlow, "too_slow"),
    (errors.ObjectStoreProtocolError, "protocol"),
    (errors.SourceCancelled, "cancelled"),
    (errors.ObjectStoreUnreachable, "unreachable"),
    (errors.ObjectStoreThrottled, "throttled"),
    (errors.ObjectChanged, "changed"),
    (errors.ObjectTruncated, "short_object"),
    (errors.ObjectTooLarge, "too_large"),
    (errors.DigestMismatchError, "digest_mismatch"),
    (errors.ManifestError, "manifest"),
    (errors.SignatureError, "manifest"),
    (errors.RemoteTrustError, "untrusted"),
    (errors.ObjectStoreError, "store_error"),
    (errors.OutputWriteError, "cache_write"),
    (errors.WeightdError, "other"),
    (OSError, "io"),
)

#: Every value :func:`source_failure_reason` can return.
SOURCE_FAILURE_REASONS: Final = frozenset({r for _, r in _SOURCE_REASONS} | {"internal"})


def source_failure_reason(error: BaseException) -> str:
    """A bounded label for why a download failed (pure)."""
    for cls, reason in _SOURCE_REASONS:
        if isinstance(error, cls):
            return reason
    return "internal"


@dataclass
class SourceMetrics:
    """Downloads from object storage. Labelled by ``kind`` (model, adapter) only: adapter
    sources come from an RPC, so a per-source label would be unbounded."""

    bytes: Counter
    seconds: Histogram
    downloads: Counter
    retries: Counter
    failures: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> SourceMetrics:
        m = cls(
            bytes=Counter(
                "weightd_source_downloaded_bytes",
                "Bytes received from object storage, by kind (model, adapter).",
                ["kind"],
                registry=registry,
            ),
            seconds=Histogram(
                "weightd_source_download_duration_seconds",
                "Time to bring a remote source into the local cache (downloads that finished, "
                "warm checks included), by kind.",
                ["kind"],
                buckets=DOWNLOAD_BUCKETS,
                registry=registry,
            ),
            downloads=Counter(
                "weightd_source_downloads",
                "Remote sources brought into the cache, by kind and outcome (downloaded, "
                "resumed, warm: nothing fetched).",
                ["kind", "outcome"],
                registry=registry,
            ),
            retries=Counter(
                "weightd_source_retries",
                "Requests to object storage the SDK retried (throttling, dropped connections).",
                registry=registry,
            ),
            failures=Counter(
                "weightd_source_failures",
                "Downloads from object storage that failed, by reason.",
                ["reason"],
                registry=registry,
            ),
        )
        for kind in ("model", "adapter"):
            m.bytes.labels(kind)
        return m
