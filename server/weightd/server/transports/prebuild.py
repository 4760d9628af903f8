"""Declared layouts, built as part of loading a model: before it reports SERVING.

Why here and not on the first request: building a layout's packs costs a pass over
the checkpoint (seconds for a GB, minutes for 140 GB), and on the first worker's
critical path that was the whole of weightd's first-engine cost. The deployments a
host serves are known ahead: declared by the operator (``--layout``) or remembered
from what workers asked for before a restart (:mod:`.layout_memory`). :meth:`prepare`
runs between verification and publication (start-up, reload, restore), builds every
rank of every such layout in one pass per layout (:mod:`weightd.server.packs.layoutbuild`,
on every core), and holds a lease on each pack for as long as that version of the
model is served, so TTL and budget eviction never take them.

One copy in host memory: once the packs are the resident copy, the model's shard
pages are dropped from the page cache (``POSIX_FADV_DONTNEED``); a gRPC fetch of
another layout reads the shards again (from the disk), every slice still checked
against its anchored digest.

A layout whose packs do not fit the shared-memory budget is logged and skipped (the
model still serves, over gRPC and with packs built on demand). A declared layout the
model cannot be cut to fails the load (the operator's mistake, said at start); a
remembered one is skipped with a warning. A build whose bytes do not match the
verified digests (a shard changed under it) marks the model broken: it serves
nothing, DATA_LOSS, until reloaded.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence

from ..base.errors import PackMemoryExhausted, UsageError, WeightdError
from ..packs.build import HostPack
from ..packs.cache import Lease
from ..packs.layoutbuild import build_layout_packs
from ..telemetry import logs
from ..weights.layouts import LayoutGroup, RankPlan
from ..weights.models import LoadedModel
from ..weights.service import WeightService
from .layout_memory import LayoutMemory
from .local_service import PackService, key_of, pack_label
from .options import PrebuildOptions

log = logging.getLogger("weightd.layouts")


class LayoutPrebuilder:
    """Builds and holds the packs of each model's declared and remembered layouts."""

    def __init__(
        self, packs: PackService, options: PrebuildOptions, memory: LayoutMemory | None
    ) -> None:
        self.packs = packs
        self.options = options
        self.memory = memory
        self._lock = threading.Lock()
        self._held: dict[str, list[Lease[HostPack]]] = {}

    def groups_for(self, model: str) -> list[tuple[LayoutGroup, str]]:
        """``(group, origin)`` to build for ``model``: every declared one, then at most
        ``max_remembered`` remembered ones (most recently asked first) that are not
        declared: a worker's asks never push a declared layout out, nor make a load
        build more than that."""
        out: list[tuple[LayoutGroup, str]] = []
        for d in self.options.declared:
            if d.model in (None, model) and all(g != d.group for g, _ in out):
                out.append((d.group, "declared"))
        if self.memory is not None and self.options.remember:
            room = self.options.max_remembered
            for g in self.memory.read(model):
                if room > 0 and all(g != have for have, _ in out):
                    out.append((g, "remembered"))
                    room -= 1
        return out

    def prepare(self, model: LoadedModel) -> int:
        """Build (or find) and hold the packs of ``model``'s layouts; drop its shard pages.
        Returns how many packs were built (not found already built).

        Raises what a declared layout's planning raises, and DataIntegrityError when a
        build finds bytes that are not the verified ones (the model is then broken).
        """
        started = time.monotonic()
        leases: list[Lease[HostPack]] = []
        built: list[str] = []
        try:
            for group, origin in self.groups_for(model.name):
                try:
                    plans = [model.plan_layout(layout) for layout in group.ranks()]
                except WeightdError as exc:
                    if origin == "declared":
                        raise UsageError(
                            f"--layout {group} cannot be served for model {model.name!r}: {exc}"
                        ) from None
                    log.warning(
                        "remembered layout %s of model %s skipped: %s", group, model.name, exc
                    )
                    continue
                try:
                    leases += self._hold(model, plans, declared=origin == "declared")
                except PackMemoryExhausted as exc:
                    log.error(
                        "layout %s of model %s not built (workers get it over gRPC): %s",
                        group,
                        model.name,
                        exc,
                    )
                    continue
                built.append(str(group))
        except BaseException:
            for lease in leases:
                self._let_go(lease)
            raise
        with self._lock:
            old = self._held.pop(model.name, [])
            if leases:
                self._held[model.name] = leases
        for lease in old:  # the version this one replaces: its packs age out by their TTL
            self._let_go(lease)
        if not built:
            return 0
        dropped = self.options.drop_shard_pages
        if dropped:
            # The identity samples a describe sends read the shards: taken now, while
            # their pages are cached, not as a cold read on the first worker's load.
            WeightService.held_files(model)
            WeightService.drop_shard_pages(model)
        logs.event(
            "layouts_built",
            model=model.name,
            layouts=";".join(built),
            packs=len(leases),
            bytes=sum(lease.pack.size for lease in leases),
            seconds=time.monotonic() - started,
            spare_packs=sum(int(lease.built and lease.pack.from_spare) for lease in leases),
            shard_pages_dropped=dropped,
        )
        return sum(int(lease.built) for lease in leases)

    def _hold(
        self, model: LoadedModel, plans: Sequence[RankPlan], *, declared: bool
    ) -> list[Lease[HostPack]]:
        """Leases on every rank's pack; the missing ones built together, in one pass."""
        labels = [f"weightd:{model.name}:{pack_label(p.layout)}" for p in plans]
        cache = self.packs.host
        missing = [i for i, p in enumerate(plans) if not cache.has(key_of(model, p.layout))]
        stash: dict[int, HostPack] = {}

        def build(i: int) -> HostPack:
            found = stash.pop(i, None)
            if found is not None:
                return found
            todo = [j for j in missing if j >= i]
            packs = build_layout_packs(
                model,
                [plans[j] for j in todo],
                [labels[j] for j in todo],
                threads=self.options.threads,
            )
            stash.update(zip(todo[1:], packs[1:], strict=True))
            return packs[0]

        leases: list[Lease[HostPack]] = []
        try:
            for i, plan in enumerate(plans):
                lease = self.packs.host_lease(
                    model, plan, build=functools.partial(build, i), declared=declared
                )
                self.packs.count_own(lease, True)
                leases.append(lease)
        except BaseException:
            for lease in leases:
                self._let_go(lease)
            raise
        finally:
            for pack in stash.values():  # built, but another asker's pack won the slot
                pack.close()
        return leases

    def after_read(self, model: LoadedModel) -> None:
        """A gRPC stream of ``model`` ended: if its packs are its resident copy, drop the
        shard pages that stream brought back (they would be the second copy)."""
        if not self.options.drop_shard_pages:
            return
        with self._lock:
            one_copy = bool(self._held.get(model.name))
        if one_copy:
            WeightService.drop_shard_pages(model)

    def _let_go(self, lease: Lease[HostPack]) -> None:
        self.packs.count_own(lease, False)
        lease.release()

    def held(self, model: str) -> int:
        """Bytes of declared packs held for ``model`` (for reports)."""
        with self._lock:
            return sum(lease.pack.size for lease in self._held.get(model, []))

    def close(self) -> None:
        with self._lock:
            held = [lease for leases in self._held.values() for lease in leases]
            self._held.clear()
        for lease in held:
            self._let_go(lease)
