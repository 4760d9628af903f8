"""A new version's shared-memory packs, built before the version is announced.

An engine told that a version is ready moves every rank to it at once; if each rank
then found no pack of its layout, the first to ask would build it on the update's
critical path (seconds for a big model) while the others wait at the engine's
collective. So the layouts in use now (any pack of the model's current content held
or idle in the cache: the workers that fetched it) are built for the new content
before ``Publish`` says ready, and stay idle in the cache (its TTL and budget apply)
for the workers to lease.
"""

from __future__ import annotations

import logging
import time

from ..base.errors import WeightdError
from ..weights.layouts import Layout
from ..weights.models import LoadedModel, Prepared
from .grants import PackInfo
from .local_service import PackService, pack_label

log = logging.getLogger("weightd.local")


def layouts_in_use(service: PackService, model: str) -> list[Layout]:
    """The layouts of ``model``'s host packs in the cache now (leased or idle), sorted."""
    found = {
        state.info.layout
        for state in service.host.states()
        if isinstance(state.info, PackInfo)
        and state.info.adapter is None
        and state.info.model == model
    }
    return sorted(found, key=pack_label)


def prepare_host_packs(service: PackService, model: LoadedModel) -> Prepared:
    """Build ``model``'s host pack for every layout of its name in use; never raises for a
    pack that cannot be built (the version is served without it: workers fall back to
    building it, or to gRPC), but a model whose bytes fail their digests does raise."""
    started = time.monotonic()
    built = 0
    for layout in layouts_in_use(service, model.name):
        try:
            lease = service.host_pack(model, layout)
        except WeightdError as exc:
            if model.broken is not None:
                raise
            log.warning("model %s: pack %s not prepared: %s", model.name, pack_label(layout), exc)
            continue
        built += int(lease.built)
        lease.release()  # idle now: the cache keeps it for its TTL
    return Prepared(built, time.monotonic() - started)
