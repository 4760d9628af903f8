"""Wiring declared layouts into the daemon: the prebuilder from the config, and start-up.

Apart from ``assembly`` so that module gains two lines, not the policy: what a failed
build at start-up means is decided here.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from ..base.errors import DataIntegrityError
from ..config import ServeConfig, build
from ..packs.spare import POOL
from ..registry.models import LoadedModel, ModelRegistry
from ..telemetry.metrics import Metrics
from ..transports.layout_memory import LayoutMemory
from ..transports.local_server import LocalServer
from ..transports.local_service import PackService
from ..transports.prebuild import LayoutPrebuilder
from .collectors import ModelCollector
from .memory import HostMemoryCollector

log = logging.getLogger("weightd")


def layout_memory(config: ServeConfig) -> LayoutMemory | None:
    """Where the layouts workers ask for are remembered, as ``config`` asks (or nowhere)."""
    directory = build.layouts_dir(config)
    forget = config.local.forget_layouts_after
    return LayoutMemory(directory, forget) if directory is not None else None


def prebuilder_for(
    config: ServeConfig, packs: PackService, memory: LayoutMemory | None
) -> LayoutPrebuilder:
    """The daemon's prebuilder over ``packs``, reading the layouts ``memory`` remembers;
    the spare pack memory (``packs/spare.py``) sized as ``config`` says."""
    POOL.configure(config.local.spare_pack_bytes)
    return LayoutPrebuilder(packs, build.prebuild_options(config), memory)


def prepare_at_start(prebuilder: LayoutPrebuilder | None, model: LoadedModel) -> None:
    """Start-up's :meth:`LayoutPrebuilder.prepare`: a build that finds changed bytes
    leaves the model published broken (DATA_LOSS, nothing served), not the daemon dead."""
    if prebuilder is None:
        return
    try:
        prebuilder.prepare(model)
    except DataIntegrityError as exc:
        if model.broken is None:
            model.broken = str(exc)
        log.error("model %s stops serving: %s", model.name, exc)


def register_host_memory(
    into: CollectorRegistry, registry: ModelRegistry, local: LocalServer, metrics: Metrics
) -> None:
    """Page cache plus shared memory per model, against its payload (``memory.py``)."""
    shards = ModelCollector(registry, metrics.scrape_errors)
    into.register(
        HostMemoryCollector(
            registry, shards.residency, local.service.host_pack_fds, metrics.scrape_errors
        )
    )
