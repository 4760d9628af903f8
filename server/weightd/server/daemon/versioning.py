"""Wiring model versions into the daemon: the RPCs' state, the publish hook, the metrics.

Kept out of :mod:`.assembly` so the factory gains a few lines, not a feature: which
hook prepares a version (:func:`version_preparation`) and what the metrics say of the
held versions (:class:`VersionCollector`) are decided here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..registry.holdbounds import HoldBounds
from ..registry.loading import Reloader
from ..registry.models import LoadedModel, ModelRegistry
from ..registry.publish import Prepared, PrepareVersion, Publisher, no_preparation
from ..registry.versions import HeldVersion, ModelVersions
from ..rpc.versions import Versions
from ..transports.local_server import LocalServer
from ..transports.prebuild import LayoutPrebuilder
from ..transports.prepare import prepare_host_packs


def create_versions(registry: ModelRegistry, bounds: HoldBounds | None = None) -> Versions:
    """Versions numbered from the registry's first publish (call before loading models)."""
    versions = ModelVersions(bounds=bounds)
    versions.attach(registry)
    return Versions(versions)


def version_preparation(
    local: LocalServer | None, prebuilder: LayoutPrebuilder | None = None
) -> PrepareVersion:
    """``prepare_version``: what a verified version needs before it is published.

    The shared-memory packs of the model's declared and remembered layouts, built in one
    pass and held while the version serves (``prebuilder``, which also drops the shard
    pages they make a second copy of), then of any other layout in use now (when the
    daemon has a side socket). Every path that publishes a version goes through it: a
    trainer's Publish, a reload (SIGHUP, the admin Reload RPC) and a restore. The one
    place to add more work of that kind (a GPU placement, say).
    """
    if local is None:
        return no_preparation
    service = local.service

    def prepare_version(model: LoadedModel) -> Prepared:
        started = time.monotonic()
        built = 0 if prebuilder is None else prebuilder.prepare(model)
        done = prepare_host_packs(service, model)
        return Prepared(built + done.packs_built, time.monotonic() - started)

    return prepare_version


def finish_versions(
    versions: Versions,
    reloader: Reloader,
    local: LocalServer | None,
    prebuilder: LayoutPrebuilder | None = None,
) -> None:
    """Give ``versions`` its publisher, the reloader the same preparation, and the side
    socket its version resolver."""
    prepare = version_preparation(local, prebuilder)
    versions.publisher = Publisher(reloader, prepare)
    if local is not None:

        def prepare_reload(model: LoadedModel) -> None:
            prepare(model)

        reloader.prepare = prepare_reload
    if local is not None:
        local.service.versions = versions.versions
        service = local.service

        def drop_packs(info: object) -> None:
            fingerprint = getattr(info, "fingerprint", "")
            service.host.discard(
                lambda key: isinstance(key, tuple) and len(key) == 2 and key[0] == fingerprint
            )

        versions.versions.on_drop(drop_packs)


class VersionCollector:
    """Held model versions: how many per model, the bytes the older ones keep, holds and
    engines per version, and what the hold bounds ended early."""

    def __init__(
        self,
        held: Callable[[], list[HeldVersion]],
        evicted: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self._held = held
        self._evicted = evicted

    def _families(self) -> tuple[Any, ...]:
        return (
            GaugeMetricFamily(
                "weightd_model_version",
                "The current version number of the model (increases with each new content).",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_model_versions_held",
                "Versions of the model the daemon holds: the current one and older ones "
                "engines still hold while they move to a version.",
                labels=["model"],
            ),
            GaugeMetricFamily(
                "weightd_model_version_holds",
                "Holds (HoldVersion) outstanding on a held version.",
                labels=["model", "version"],
            ),
            GaugeMetricFamily(
                "weightd_model_version_engines",
                "Distinct holders (engines) holding a version.",
                labels=["model", "version"],
            ),
            GaugeMetricFamily(
                "weightd_model_old_versions_bytes",
                "Tensor bytes of the model's older versions still held (their checkpoint "
                "files stay open and their packs in shared memory); at most "
                "versions.max_old such versions.",
                labels=["model"],
            ),
            CounterMetricFamily(
                "weightd_version_holds_evicted",
                "Holds ended before their release or TTL to keep a client within "
                "versions.max_holds_per_client or everyone within versions.max_holds.",
            ),
            CounterMetricFamily(
                "weightd_model_versions_evicted",
                "Held older versions dropped, holds and all, past versions.max_old.",
            ),
        )

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        current, count, holds, engines, old_bytes, holds_evicted, versions_evicted = (
            self._families()
        )
        per_model: dict[str, int] = {}
        per_model_old: dict[str, int] = {}
        for v in self._held():
            per_model[v.model] = per_model.get(v.model, 0) + 1
            per_model_old[v.model] = per_model_old.get(v.model, 0)
            if v.current:
                current.add_metric([v.model], float(v.version))
            else:
                per_model_old[v.model] += v.total_bytes
            holds.add_metric([v.model, str(v.version)], float(v.holds))
            engines.add_metric([v.model, str(v.version)], float(v.engines))
        for model, n in per_model.items():
            count.add_metric([model], float(n))
            old_bytes.add_metric([model], float(per_model_old[model]))
        ended, dropped = self._evicted()
        holds_evicted.add_metric([], float(ended))
        versions_evicted.add_metric([], float(dropped))
        yield from (current, count, holds, engines, old_bytes, holds_evicted, versions_evicted)
