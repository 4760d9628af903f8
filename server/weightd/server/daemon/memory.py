"""Where each model's bytes live in host memory, measured on scrape: one copy or two.

A model is held in host memory in two places: its shard files' pages in the page
cache, and its rank packs in shared memory. With a layout's packs built the shard
pages are dropped (``transports/prebuild.py``), so the sum should be about one
payload; these series say whether it is:

* ``weightd_shm_pack_resident_bytes{model}``: bytes of its packs resident (``mincore``
  on each pack's memfd; shmem is never dropped by ``drop_caches``, only swapped);
* ``weightd_model_host_bytes{model}``: page cache (``weightd_model_resident_bytes``)
  plus that;
* ``weightd_model_host_copies_ratio{model}``: that sum over the payload
  (``weightd_model_tensor_bytes``): 1.0 is one copy, 2.0 the same bytes twice.

Read on scrape through the daemon's own descriptors, never on the hot path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from ..registry.models import LoadedModel, ModelRegistry
from ..store.residency import ResidencyUnavailable, resident_bytes

log = logging.getLogger("weightd.metrics")


@dataclass(frozen=True)
class HostCopies:
    """One model's bytes in host memory (all measured with ``mincore``)."""

    model: str
    payload: int
    page_cache: int
    shm: int

    @property
    def total(self) -> int:
        return self.page_cache + self.shm

    @property
    def ratio(self) -> float:
        return self.total / self.payload if self.payload else 0.0


def pack_residency(fds: Sequence[tuple[int, int]]) -> int:
    """Resident bytes of packs given as ``(memfd, size)``."""
    return sum(resident_bytes(fd, size)[1] for fd, size in fds)


def host_copies(
    model: LoadedModel,
    page_cache: Callable[[LoadedModel], tuple[int, int] | None],
    packs: Sequence[tuple[int, int]],
) -> HostCopies | None:
    """``model``'s copies, or None when residency cannot be asked of this kernel."""
    cached = page_cache(model)
    if cached is None:
        return None
    try:
        shm = pack_residency(packs)
    except ResidencyUnavailable:
        return None
    return HostCopies(model.name, model.checkpoint.total_bytes, cached[1], shm)


class HostMemoryCollector:
    """The three series above, per model with measurable residency."""

    def __init__(
        self,
        registry: ModelRegistry,
        page_cache: Callable[[LoadedModel], tuple[int, int] | None],
        packs: Callable[[], dict[str, list[tuple[int, int]]]],
        errors: Counter | None = None,
    ) -> None:
        self._registry = registry
        self._page_cache = page_cache
        self._packs = packs
        self._errors = errors

    def describe(self) -> list[Metric]:
        return list(self._families())

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "weightd_shm_pack_resident_bytes",
                "Bytes of the model's shared-memory packs resident in memory (mincore).",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_model_host_bytes",
                "Host memory holding the model's bytes: shard pages in the page cache plus "
                "resident shared-memory packs.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_model_host_copies_ratio",
                "weightd_model_host_bytes over the model's payload: 1 is one copy in host "
                "memory, 2 the same bytes twice (page cache and packs).",
                labels=["model"],
            ),
        )

    def collect(self) -> Iterator[Metric]:
        shm, total, ratio = self._families()
        try:
            packs = self._packs()
        except OSError as exc:
            log.debug("pack residency skipped: %s", exc)
            if self._errors is not None:
                self._errors.labels("residency").inc()
            packs = None
        for model in self._registry.models():
            if packs is None:
                break
            try:
                found = host_copies(model, self._page_cache, packs.get(model.name, []))
            except OSError as exc:  # a pack freed under the scrape: skip this one
                log.debug("host copies of %s skipped: %s", model.name, exc)
                continue
            if found is None:
                continue
            shm.add_metric([model.name], float(found.shm))
            total.add_metric([model.name], float(found.total))
            ratio.add_metric([model.name], found.ratio)
        yield from (shm, total, ratio)
