"""Prometheus series for LoRA adapters: what is loaded and held, what happened, why loads fail.

**No adapter-name label.** Adapter names are chosen by whoever calls ``LoadAdapter``,
at run time and without bound over the daemon's life: a label per name would grow
the counters' series forever (a counter's series cannot be dropped without breaking
``rate``). Every series here is therefore an aggregate over adapters; per-adapter
state (version, digest, leases, pinned) is what ``ListAdapters`` is for. The only
labels are bounded by this module: a load's rejection ``reason`` (a fixed table,
:data:`REJECTION_REASONS`).

Counters are driven by the registry's own events (load, replace, unload, evict), so
they count what was published, once, however many requests coalesced into it; gauges
are read from the registry and the pack service on scrape, never on a fetch's path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from ..base import errors
from .registry import AdapterEvent, AdapterRegistry

#: LoadAdapter reads and hashes megabytes to a few hundred: milliseconds to seconds.
LOAD_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

#: Why a load was refused, most specific class first (pure table; see rejection_reason).
_REASONS: Final[tuple[tuple[type[BaseException], str], ...]] = (
    (errors.UnsupportedAdapterFeature, "unsupported_feature"),
    (errors.AdapterConfigError, "config"),
    (errors.AdapterFormatError, "format"),
    (errors.AdapterTensorError, "tensor"),
    (errors.AdapterTargetError, "target"),
    (errors.AdapterShapeError, "shape"),
    (errors.AdapterDtypeError, "dtype"),
    (errors.AdapterBaseMismatch, "base_mismatch"),
    (errors.UnsafePathError, "unsafe_path"),
    (errors.MissingFileError, "missing_file"),
    (errors.HeaderError, "header"),
    (errors.DigestMismatchError, "digest_mismatch"),
    (errors.AdapterBudgetExhausted, "budget"),
    (errors.InvalidRequest, "invalid_request"),
    (errors.ModelNotFound, "model_not_found"),
    (errors.WeightdError, "other"),
    (OSError, "io"),
)

#: ``weightd_adapter_resolves_total``'s outcome label: its whole domain.
RESOLVE_OUTCOMES: Final = ("held", "loaded", "not_found", "refused")

#: Every value :func:`rejection_reason` can return: the label's whole domain.
REJECTION_REASONS: Final = tuple(dict.fromkeys([r for _, r in _REASONS] + ["internal"]))


def rejection_reason(error: BaseException) -> str:
    """A bounded label for why a LoadAdapter failed (pure)."""
    for cls, reason in _REASONS:
        if isinstance(error, cls):
            return reason
    return "internal"


@dataclass(frozen=True, slots=True)
class AdapterPackUsage:
    """Adapter packs in every placement: how many, their bytes, and leases on them."""

    packs: int
    bytes: int
    leases: int


class AdapterMetrics:
    """The event counters and the load histogram; :meth:`create` also registers the gauges."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, help: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, help, labels, registry=registry)

        self.loads = counter(
            "weightd_adapter_loads", "Adapters published under a name not loaded before."
        )
        self.replaces = counter(
            "weightd_adapter_replaces", "New versions published over a loaded adapter."
        )
        self.unloads = counter("weightd_adapter_unloads", "Adapters unloaded by an operator.")
        self.evictions = counter(
            "weightd_adapter_evictions",
            "Adapters evicted (least recently used) to fit another in the adapter budget.",
        )
        self.rejections = counter(
            "weightd_adapter_rejections",
            "LoadAdapter requests refused, by reason; nothing was published or evicted.",
            ("reason",),
        )
        for reason in REJECTION_REASONS:
            self.rejections.labels(reason)  # every reason from the first scrape, at zero
        self.resolves = counter(
            "weightd_adapter_resolves",
            "ResolveAdapter requests (an engine naming an adapter), by outcome: held "
            "(already loaded), loaded (loaded on request, or waited for that load), "
            "not_found, refused.",
            ("outcome",),
        )
        for outcome in RESOLVE_OUTCOMES:
            self.resolves.labels(outcome)
        self.load_seconds = Histogram(
            "weightd_adapter_load_duration_seconds",
            "LoadAdapter requests that published a version: read, verify, hash and publish.",
            buckets=LOAD_BUCKETS,
            registry=registry,
        )

    @classmethod
    def create(
        cls,
        prom: CollectorRegistry,
        adapters: AdapterRegistry,
        packs: Callable[[], AdapterPackUsage] | None,
    ) -> AdapterMetrics:
        """Instruments on ``prom``, counting ``adapters``' events; ``packs``: the side
        socket's adapter packs (None: the daemon builds no packs, no pack series)."""
        metrics = cls(prom)
        adapters.on_event(metrics.event)
        prom.register(AdapterCollector(adapters, packs))
        prom.register(AdapterBudgetCollector(lambda: adapters.budget_bytes))
        return metrics

    def event(self, e: AdapterEvent) -> None:
        if e.kind == "load":
            self.loads.inc()
        elif e.kind == "replace":
            self.replaces.inc()
        elif e.reason == "evicted":
            self.evictions.inc()
        else:
            self.unloads.inc()

    def rejected(self, error: BaseException) -> None:
        self.rejections.labels(rejection_reason(error)).inc()

    def published(self, seconds: float) -> None:
        self.load_seconds.observe(seconds)

    def resolved(self, outcome: str) -> None:
        self.resolves.labels(outcome).inc()


class AdapterBudgetCollector:
    """``weightd_adapter_budget_bytes``, only for a daemon started with an adapter budget."""

    def __init__(self, source: Callable[[], int | None]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return [self._family()]

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "weightd_adapter_budget_bytes", "Bytes of adapters the daemon may hold at once."
        )

    def collect(self) -> Iterator[Metric]:
        budget = self._source()
        if budget is not None:
            g = self._family()
            g.add_metric([], float(budget))
            yield g


class AdapterCollector:
    """Scrape-time gauges of the registry (and of adapter packs, where packs exist)."""

    def __init__(
        self, registry: AdapterRegistry, packs: Callable[[], AdapterPackUsage] | None
    ) -> None:
        self._registry = registry
        self._packs = packs

    def describe(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        def gauge(name: str, help: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help)

        base = (
            gauge("weightd_adapters_loaded", "Adapters loaded (current versions)."),
            gauge("weightd_adapters_pinned", "Loaded adapters pinned against eviction."),
            gauge(
                "weightd_adapter_versions",
                "Adapter versions held in memory: the current ones, and replaced or "
                "unloaded ones that a fetch or a mapped pack still holds.",
            ),
            gauge(
                "weightd_adapter_bytes",
                "Bytes of every adapter version held in memory (weights and config).",
            ),
            gauge(
                "weightd_adapter_leases",
                "Holds on adapter versions: gRPC fetches in flight and leased adapter packs.",
            ),
        )
        if self._packs is None:
            return base
        return (
            *base,
            gauge("weightd_adapter_packs", "Adapter rank packs (shared memory and GPU)."),
            gauge("weightd_adapter_pack_bytes", "Bytes of adapter rank packs."),
            gauge("weightd_adapter_pack_leases", "Worker leases on adapter rank packs."),
        )

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        current = self._registry.current()
        versions, holds, nbytes = self._registry.stats()
        values: list[float] = [
            len(current),
            sum(1 for _, pinned, _ in current if pinned),
            versions,
            nbytes,
            holds,
        ]
        if self._packs is not None:
            usage = self._packs()
            values += [usage.packs, usage.bytes, usage.leases]
        for family, value in zip(families, values, strict=True):
            family.add_metric([], float(value))
            yield family
