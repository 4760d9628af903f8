"""What every listener serves, built before any of them binds: the daemon's domain.

Apart from :mod:`.assembly` (which binds the listeners) so that each part is built
once, in order, with its collaborators passed in: the registry and its versions, the
weights door both edges call, the adapter service, the side socket's packs and the
declared layouts' prebuilder, the version preparation, the reloader and the publisher.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from weightd.common.cuda_driver import CudaDriver

from ..adapters.registry import AdapterRegistry
from ..adapters.service import AdapterService
from ..config import ServeConfig, build
from ..registry.loading import Reloader
from ..registry.models import ModelRegistry
from ..registry.publish import Publisher
from ..registry.versions import ModelVersions
from ..rpc.adapters import Adapters
from ..rpc.versions import Versions
from ..sources.location import default_model_name
from ..sources.resolver import SourceResolver
from ..telemetry.metrics import Metrics, SourceMetrics
from ..transports.local_service import PackService
from ..transports.prebuild import LayoutPrebuilder
from ..weights.service import WeightService
from . import listeners
from .collectors import GpuMemoryCollector, ModelCollector, ModelStateCollector
from .prebuilding import layout_memory, prebuilder_for
from .versioning import (
    VersionCollector,
    drop_packs_with_versions,
    reload_preparation,
    version_preparation,
)


@dataclass
class Domain:
    """What every listener serves, built before any listens, each part given its
    collaborators at construction (the weights door, the packs, the version hooks)."""

    registry: ModelRegistry
    metrics: Metrics | None
    metrics_registry: CollectorRegistry | None
    resolver: SourceResolver
    adapter_service: AdapterService
    adapters: Adapters
    weights: WeightService
    reloader: Reloader
    versions: Versions
    #: The side socket's packs and the declared layouts' prebuilder (Unix listeners).
    packs: PackService | None = None
    prebuilder: LayoutPrebuilder | None = None


def build_domain(
    config: ServeConfig,
    local: bool,
    driver: CudaDriver | None,
    metrics_registry: CollectorRegistry | None,
) -> Domain:
    """The registry and everything both edges call; ``local``: the side socket is served."""
    registry = ModelRegistry()
    metrics = None
    if metrics_registry is not None:
        metrics = Metrics.create(metrics_registry, version=listeners.version())
        metrics_registry.register(ModelCollector(registry, metrics.scrape_errors))
        metrics_registry.register(ModelStateCollector(registry))
        metrics_registry.register(GpuMemoryCollector())
    # Every configured model is known (``loading``) before anything listens (the side
    # socket accepts from its creation): a request that names no model during start-up
    # then hears "still being verified" (UNAVAILABLE, retried), not "this daemon serves
    # 0 models" (a caller's mistake it did not make).
    expect_models(registry, metrics, [(m.name, m.value) for m in config.model])
    source_metrics = (
        SourceMetrics.create(metrics_registry) if metrics_registry is not None else None
    )
    verify = build.verify_options(config)
    resolver = SourceResolver(build.source_options(config), verify, source_metrics)
    adapter_service = AdapterService(
        registry,
        AdapterRegistry(config.adapters.budget_bytes),
        list(config.adapters.root),
        resolver=resolver,
        autoload=build.autoload_policy(config),
        # A quarter of the stream slots may load, a quarter wait: the rest stay free.
        autoload_slots=max(1, config.server.max_workers // 4),
    )
    model_versions = ModelVersions(bounds=config.versions.bounds())  # numbered from the
    # registry's first publish
    model_versions.attach(registry)
    weights = WeightService(registry, model_versions)
    packs = prebuilder = None
    if local:
        memory = layout_memory(config)
        packs = PackService(
            weights, build.local_config(config), driver, adapter_service, memory=memory
        )
        prebuilder = prebuilder_for(config, packs, memory)
        drop_packs_with_versions(model_versions, packs)
    prepare = version_preparation(packs, prebuilder)
    reloader = Reloader(
        registry,
        metrics,
        sources={m.name or default_model_name(m.value): m.value for m in config.model},
        options=verify,
        resolver=resolver,
        prepare=reload_preparation(packs, prepare),
    )
    if metrics_registry is not None:
        metrics_registry.register(VersionCollector(model_versions.held, model_versions.evictions))
    return Domain(
        registry,
        metrics,
        metrics_registry,
        resolver,
        adapter_service,
        Adapters(adapter_service),
        weights,
        reloader,
        Versions(model_versions, Publisher(reloader, prepare)),
        packs,
        prebuilder,
    )


def expect_models(
    registry: ModelRegistry, metrics: Metrics | None, models: list[tuple[str | None, str]]
) -> list[tuple[str, str]]:
    """``models`` by name, each registered as ``loading`` (idempotent)."""
    named = [(name or default_model_name(d), d) for name, d in models]
    for name, _ in named:
        registry.expect(name)
        if metrics is not None:
            metrics.model_known(name)
    return named
