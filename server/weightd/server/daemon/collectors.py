"""Collectors that read the daemon's state when Prometheus scrapes, never on the hot path.

Each collector yields series only for state that exists: no model, no model series;
no CUDA initialised in this process, no GPU series; no pinned pool or shared-memory
packs registered, none of theirs. A zero is only ever reported when it was measured.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from ..adapters.collector import AdapterBudgetCollector, AdapterMetrics, AdapterPackUsage
from ..adapters.service import AdapterService
from ..registry.models import MODEL_STATES, LoadedModel, ModelRegistry
from ..store.residency import ResidencyUnavailable, resident_bytes
from ..store.shards import FileIdentity
from ..transports.local_service import PackService

log = logging.getLogger("weightd.metrics")


class ModelCollector:
    """Per model: readiness, tensor bytes, bytes mapped and bytes resident in the page cache.

    Residency is asked of the kernel (``mincore``) for each shard through the store's
    own descriptor, so it describes the very inode the daemon verified and serves,
    even if the path was since replaced. A descriptor that was closed (and possibly
    reused) by a concurrent reload is detected by comparing the inode with the one
    verified, and that shard is skipped for this scrape (counted in
    ``weightd_scrape_errors_total{collector="residency"}``).
    """

    def __init__(self, registry: ModelRegistry, errors: Counter | None = None) -> None:
        self._registry = registry
        self._errors = errors

    def describe(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily(
                "weightd_model_ready",
                "1 when the model is verified and served, 0 while loading or after a failure.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_model_tensor_bytes",
                "Tensor payload bytes of the served version of the model.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_model_mapped_bytes",
                "Bytes of the model's shard files the daemon holds open (clamped to their "
                "current size), i.e. what the page cache could hold for it.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_model_resident_bytes",
                "Bytes of the model's shard files resident in the page cache (mincore).",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_model_trust",
                "1 per served model: the trust root that proved its served version (kind: "
                "oms-key, oms-certificate, manifest, manifest-unsigned, hf-cache, "
                "object-store, none; root: DescribeModel's trust_root).",
                labels=["model", "kind", "root"],
            ),
        )

    def collect(self) -> Iterator[Metric]:
        ready, tensor_bytes, mapped, resident, trust = self._families()
        loaded = {m.name: m for m in self._registry.models()}
        for name in self._registry.names():
            ready.add_metric([name], 1.0 if self._registry.is_ready(name) else 0.0)
            model = loaded.get(name)
            if model is None:
                continue
            tensor_bytes.add_metric([name], float(model.checkpoint.total_bytes))
            root = model.trust_root
            trust.add_metric([name, root.partition(":")[0] or "none", root], 1.0)
            measured = self._residency(model)
            if measured is not None:
                mapped.add_metric([name], float(measured[0]))
                resident.add_metric([name], float(measured[1]))
        yield from (ready, tensor_bytes, mapped, resident, trust)

    def residency(self, model: LoadedModel) -> tuple[int, int] | None:
        """``(mapped, resident)`` bytes of ``model``'s shard files (None: not measurable)."""
        return self._residency(model)

    def _residency(self, model: LoadedModel) -> tuple[int, int] | None:
        total_mapped = total_resident = 0
        for shard in model.store.shards.values():
            try:
                now = FileIdentity.of(os.fstat(shard.fd))
                if (now.dev, now.ino) != (shard.identity.dev, shard.identity.ino):
                    raise OSError(f"descriptor of {shard.path} no longer refers to it")
                mapped, resident = resident_bytes(shard.fd, shard.identity.size)
            except ResidencyUnavailable:
                return None
            except OSError as exc:
                log.debug("residency of %s skipped: %s", shard.path, exc)
                if self._errors is not None:
                    self._errors.labels("residency").inc()
                return None
            total_mapped += mapped
            total_resident += resident
        return total_mapped, total_resident


class ModelStateCollector:
    """``weightd_model_state{model,state}``: 1 for the model's state, 0 for the others.

    States: loading, ready, stale (serving its verified files, which were since replaced
    or removed on disk), broken (serving nothing until restored or reloaded), failed (its
    load failed and no version serves; the other models do; a reload retries it). The
    reason is in ListModels and the log, never in a label (unbounded text).
    """

    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "weightd_model_state",
            "1 for the model's current state (loading, ready, stale, broken, failed), 0 for the "
            "others.",
            labels=["model", "state"],
        )

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for name in self._registry.names():
            state, _ = self._registry.state(name)
            for candidate in MODEL_STATES:
                family.add_metric([name, candidate], 1.0 if candidate == state else 0.0)
        yield family


def _loaded_torch() -> ModuleType | None:
    """torch, only if something in this process already imported it (never imported here)."""
    return sys.modules.get("torch")


class GpuMemoryCollector:
    """CUDA memory held by this process's torch allocator, per device.

    Series exist only when torch is already imported, CUDA is available *and* already
    initialised in this process: a scrape must never create a CUDA context (hundreds of
    MiB of GPU memory) just to report that nothing is allocated.
    """

    def __init__(self, torch_module: Callable[[], Any] = _loaded_torch) -> None:
        self._torch = torch_module

    def describe(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "weightd_gpu_allocated_bytes",
                "GPU memory allocated by the daemon's torch caching allocator, per device.",
                labels=["device"],
            ),
            GaugeMetricFamily(
                "weightd_gpu_reserved_bytes",
                "GPU memory reserved by the daemon's torch caching allocator, per device.",
                labels=["device"],
            ),
        )

    def collect(self) -> Iterator[Metric]:
        torch = self._torch()
        if torch is None:
            return
        cuda = torch.cuda
        if not cuda.is_available() or not cuda.is_initialized():
            return
        allocated, reserved = self._families()
        for index in range(cuda.device_count()):
            device = f"cuda:{index}"
            allocated.add_metric([device], float(cuda.memory_allocated(index)))
            reserved.add_metric([device], float(cuda.memory_reserved(index)))
        yield allocated
        yield reserved


@dataclass(frozen=True, slots=True)
class PinnedState:
    """What a pinned (page-locked) staging pool reports: bytes in use and its budget."""

    used_bytes: int
    budget_bytes: int


class PinnedMemoryCollector:
    """``weightd_pinned_bytes`` and ``weightd_pinned_budget_bytes`` from a pinned pool.

    Registered only by a daemon that has a pool; ``source`` returning None (the pool is
    not set up yet) yields nothing.
    """

    def __init__(self, source: Callable[[], PinnedState | None]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily("weightd_pinned_bytes", "Page-locked host memory in use."),
            GaugeMetricFamily(
                "weightd_pinned_budget_bytes", "Page-locked host memory the daemon may use."
            ),
        )

    def collect(self) -> Iterator[Metric]:
        state = self._source()
        if state is None:
            return
        used, budget = self._families()
        used.add_metric([], float(state.used_bytes))
        budget.add_metric([], float(state.budget_bytes))
        yield used
        yield budget


@dataclass(frozen=True, slots=True)
class ShmPackState:
    """One model's shared-memory packs: bytes held and leases outstanding."""

    model: str
    bytes: int
    leases: int


class ShmPackCollector:
    """``weightd_shm_pack_bytes`` and ``weightd_shm_pack_leases`` per model.

    Registered only by a daemon that builds shared-memory packs; models without packs
    have no series.
    """

    def __init__(self, source: Callable[[], Sequence[ShmPackState]]) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "weightd_shm_pack_bytes",
                "Shared-memory bytes holding per-rank packs, per model.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_shm_pack_leases",
                "Shared-memory pack leases held by workers, per model.",
                labels=["model"],
            ),
        )

    def collect(self) -> Iterator[Metric]:
        packs = self._source()
        if not packs:
            return
        size, leases = self._families()
        for p in packs:
            size.add_metric([p.model], float(p.bytes))
            leases.add_metric([p.model], float(p.leases))
        yield size
        yield leases


#: Collectors whose series appear only when their state exists; dashboards may query
#: their metrics even though a CPU-only daemon's scrape lacks them.
CONDITIONAL_COLLECTORS: tuple[type, ...] = (
    GpuMemoryCollector,
    PinnedMemoryCollector,
    ShmPackCollector,
    AdapterBudgetCollector,
)


def adapter_metrics(
    prom: CollectorRegistry, adapters: AdapterService, packs: PackService | None
) -> AdapterMetrics:
    """The daemon's adapter metrics; pack gauges when it has a side socket's packs."""
    source: Callable[[], AdapterPackUsage] | None = None
    if packs is not None:
        service = packs

        def usage() -> AdapterPackUsage:
            return AdapterPackUsage(*service.adapter_usage())

        source = usage
    return AdapterMetrics.create(prom, adapters.registry, source)
