"""The side channel's request handling: resolve, plan, lease a pack, answer. No sockets here.

Like the gRPC servicer it is thin, and errors become a status in one place
(:func:`~weightd.server.base.errors.error_status`); a :class:`TransportError` is flagged
as the transport's own failure, so a client on ``transport="auto"`` falls back to
gRPC instead of giving up.

One host pack per (model content, layout): the whole layout, ``vocab_pad`` included
(a padded vocabulary cut is other bytes than equal blocks), and the model's
fingerprint (its config and verified tensor digests), so a reload with identical bytes
keeps its packs and a changed model never reuses a stale one. A GPU pack is built from the
host pack (which must therefore fit the shared-memory budget too). LoRA adapter packs
(``AcquirePack.adapter``) live in the same caches and budgets, keyed by adapter version
instead; their rules are in :mod:`weightd.server.adapters.packing`. What a grant says
(the pack records, the leases held, the ``PackGrant`` itself) is in :mod:`.grants`.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Final

from weightd.common.cuda_driver import CudaDriver
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

from ..adapters.packing import (
    AdapterPackLease,
    adapter_key,
    adapter_key_matches,
    adapter_tag,
    build_adapter_pack,
)
from ..adapters.registry import AdapterVersion
from ..adapters.service import AdapterService, check_tp_only
from ..base.bounds import check_fields
from ..base.cleanup import release_frames
from ..base.errors import (
    AdapterNotFound,
    AdminOnly,
    Code,
    DataIntegrityError,
    LocalProtocolError,
    NoAdapters,
    PackPending,
    PlacementUnavailable,
    StaleGrant,
    TransportError,
    echo,
    error_status,
)
from ..packs.build import HostPack, layout_pack
from ..packs.cache import Lease, PackCache
from ..packs.layoutbuild import build_host_pack
from ..telemetry import logs
from ..weights.layouts import Layout, LayoutGroup, RankPlan
from ..weights.models import LoadedModel
from ..weights.service import WeightService
from .cuda_ipc import CudaPack, CudaPlacer
from .grants import Held, Outcome, PackInfo, answer, wire_layout
from .layout_memory import LayoutMemory
from .local_describe import describe
from .options import LocalConfig
from .pinned import HostPinner

log = logging.getLogger("weightd.local")

PROTOCOL_VERSION: Final = 1


def pack_label(layout: Layout) -> str:
    """A pack's layout in its memfd name and log lines: ``tp2:r1``, ``tp2:r1:pp1/2:v64``."""
    label = f"tp{layout.tp_size}:r{layout.tp_rank}"
    if layout.pp_size > 1:
        label += f":pp{layout.pp_rank}/{layout.pp_size}"
    if layout.ep_size > 1:
        label += f":ep{layout.ep_rank}/{layout.ep_size}"
    if layout.vocab_pad:
        label += f":v{layout.vocab_pad}"
    return label


def key_of(model: LoadedModel, layout: Layout) -> tuple[str, Layout]:
    """A host pack's key: the served content (fingerprint) and the whole layout."""
    return (model.fingerprint, layout)


def local_error(error: BaseException, what: str) -> lpb.LocalError:
    """The side channel's answer to a failure: its status from the one table, with the
    error's class and fields (``reason``, ``metadata``) as gRPC's rich status has them.

    A :class:`TransportError` is flagged as the transport's own failure, so a client on
    ``transport="auto"`` falls back to gRPC instead of giving up.
    """
    status = error_status(error)
    if status.code is Code.INTERNAL:
        log.error("side-channel %s failed", what, exc_info=error)
    return lpb.LocalError(
        code=status.code,
        detail=status.detail,
        transport=isinstance(error, TransportError),
        reason=status.reason,
        metadata=status.metadata,
        pending=isinstance(error, PackPending),
    )


class PackService:
    """The side socket's requests over the same :class:`WeightService` as gRPC's Fetch."""

    def __init__(
        self,
        weights: WeightService,
        config: LocalConfig,
        driver: CudaDriver | None = None,
        adapters: AdapterService | None = None,
        *,
        memory: LayoutMemory | None = None,
    ) -> None:
        #: The domain door (model at version, plan, marking broken), gRPC's Fetch's too.
        self.weights = weights
        self.adapters = adapters
        #: Open side-channel connections, for stats; the socket server sets it.
        self.connections: Callable[[], int] = lambda: 0
        self.boot_id = uuid.uuid4().hex
        #: Where the layouts workers ask for are remembered (None: nowhere).
        self.memory = memory
        #: Pack id -> leases the daemon itself holds (declared layouts, ``prebuild``):
        #: not a worker's, so stats and metrics count them apart.
        self._own_leases: Counter[int] = Counter()
        self._own_lock = threading.Lock()
        counter = itertools.count(1)
        id_lock = threading.Lock()

        def next_id() -> int:
            with id_lock:
                return next(counter)

        self.host = PackCache[HostPack](
            "shared-memory pack", config.resolved_host_budget(), config.ttl_seconds, next_id
        )
        self.pinner = (
            HostPinner(driver, config.resolved_pin_budget()) if config.pin and driver else None
        )
        self.placer = CudaPlacer(driver) if config.cuda_ipc and driver else None
        self.gpu: dict[str, PackCache[CudaPack]] = {
            gpu: PackCache[CudaPack](
                f"GPU {gpu} pack", config.cuda_budget_bytes, config.ttl_seconds, next_id
            )
            for gpu in (self.placer.gpus if self.placer else {})
        }
        if adapters is not None:
            adapters.registry.on_drop(self._adapter_dropped)
            adapters.on_loaded(self._prebuild_adapter)

    def count_own(self, lease: Lease[HostPack], own: bool) -> None:
        """Count ``lease`` as the daemon's own (``own``) or no longer (prebuild's).

        A pack lease, not a hold: "hold" is what keeps a version (model or adapter)."""
        with self._own_lock:
            self._own_leases[lease.pack_id] += 1 if own else -1
            if self._own_leases[lease.pack_id] <= 0:
                del self._own_leases[lease.pack_id]

    def _own(self) -> Counter[int]:
        with self._own_lock:
            return Counter(self._own_leases)

    def host_usage(self) -> dict[str, tuple[int, int]]:
        """Model name -> (bytes, worker leases) of its shared-memory packs, for the metrics."""
        usage: dict[str, tuple[int, int]] = {}
        own = self._own()
        for state in self.host.states():
            if isinstance(state.info, PackInfo) and state.info.adapter is None:
                size, leases = usage.get(state.info.model, (0, 0))
                workers = state.leases - own[state.pack_id]
                usage[state.info.model] = (size + state.size, leases + workers)
        return usage

    def host_pack_fds(self) -> dict[str, list[tuple[int, int]]]:
        """Model name -> ``(memfd, size)`` of its built shared-memory packs (a scrape's
        residency question; a pack freed meanwhile makes that question fail, not lie)."""
        out: dict[str, list[tuple[int, int]]] = {}
        for state in self.host.states():
            info, pack = state.info, state.pack
            if isinstance(info, PackInfo) and info.adapter is None and isinstance(pack, HostPack):
                out.setdefault(info.model, []).append((pack.fd, pack.size))
        return out

    def adapter_usage(self) -> tuple[int, int, int]:
        """(packs, bytes, leases) of adapter packs in every placement, for the metrics."""
        packs = size = leases = 0
        for cache in self._caches():
            for state in cache.states():
                if isinstance(state.info, PackInfo) and state.info.adapter is not None:
                    packs, size, leases = packs + 1, size + state.size, leases + state.leases
        return packs, size, leases

    def _adapter_dropped(self, name: str, version: int) -> None:
        """The registry let ``version`` of ``name`` go: its idle packs go now, not at TTL."""
        match = adapter_key_matches(name, version)
        for cache in self._caches():
            cache.discard(match)

    def _prebuild_adapter(self, v: AdapterVersion) -> None:
        """Build the TP=1 pack of ``v``, just loaded, before the load answers.

        A same-host vLLM engine leases exactly that pack on the version's first request
        (``weightd.vllm.lora.hub``): built at load, an operator-loaded version's first
        request finds it built, and one loaded on request builds it once, in the load it
        waits for anyway. The pack is then an idle pack of the cache: its budget, TTL and
        the version's drop free it as any other's. A failure is logged, not raised: the
        load succeeded, and a request that needs the pack builds it again or says why.
        """
        req = lpb.AcquirePack(
            adapter=v.name,
            adapter_version=v.version,
            layout=pb.Layout(tp_size=1, tp_rank=0),
            placement=lpb.PLACEMENT_HOST,
        )
        try:
            self._adapter_lease(req).release()
        except Exception as exc:
            log.info("adapter %s v%d: pack not built at load: %s", echo(v.name), v.version, exc)

    def _caches(self) -> list[PackCache[HostPack] | PackCache[CudaPack]]:
        return [self.host, *self.gpu.values()]

    # --- requests --------------------------------------------------------------------------

    def hello(self) -> lpb.LocalHello:
        placements = [lpb.PLACEMENT_HOST] + ([lpb.PLACEMENT_CUDA] if self.placer else [])
        return lpb.LocalHello(
            protocol_version=PROTOCOL_VERSION,
            boot_id=self.boot_id,
            placements=placements,
            gpu_uuids=sorted(self.gpu),
            pid=os.getpid(),
        )

    def handle(self, request: lpb.LocalRequest) -> Outcome:
        """Answer one request; every failure becomes a LocalError, never an exception."""
        which = request.WhichOneof("request")
        try:
            check_fields(request)  # the same bounds as every gRPC request
            if which == "acquire":
                return self._acquire(request.acquire)
            if which == "attach":
                return self._attach(request.attach)
            if which == "stats":
                return Outcome(lpb.LocalResponse(stats=self.stats()), [])
            if which in ("publish", "publish_memfd"):
                raise AdminOnly(
                    "publishing from memory is an admin request: this is the worker side "
                    "socket; send it to the admin side socket (<admin socket>.local)"
                )
            if which == "describe":
                return describe(self.weights, request.describe)
            raise LocalProtocolError(f"request {which or '(empty)'} is not one this daemon knows")
        except Exception as exc:
            return Outcome(lpb.LocalResponse(error=local_error(exc, which or "request")), [])

    def _acquire(self, req: lpb.AcquirePack) -> Outcome:
        if req.adapter:
            return self._acquire_adapter(req)
        # The model at the version, and the whole layout validated and planned, by the
        # same service as a gRPC Fetch: a pipeline stage or an expert rank gets exactly
        # what Fetch would stream it.
        model = self.weights.model(req.model, req.version)
        if req.names:
            self.weights.plan(model, req.layout, req.names)  # unknown or repeated names fail
        plan = self.weights.plan(model, req.layout)
        layout = plan.layout
        host = self.host_lease(model, plan, wait=not req.no_wait, remember=True)
        kinds = list(req.slice_digests)
        if req.placement in (lpb.PLACEMENT_HOST, lpb.PLACEMENT_UNSPECIFIED):
            out = answer(self.boot_id, host, list(req.names), kinds)
        else:
            key, info = key_of(model, layout), host.info
            assert isinstance(info, PackInfo)
            out = answer(self.boot_id, self._place(req, host, key, info), list(req.names), kinds)
        if out.response.HasField("grant"):
            out.response.grant.version = model.version
        return out

    def host_pack(self, model: LoadedModel, layout: Layout) -> Lease[HostPack]:
        """A lease on ``model``'s host pack of ``layout``, built now (once) if absent.

        ``model`` need not be published yet: a new version's packs are built before
        it is announced (:mod:`.prepare`).
        """
        return self.host_lease(model, model.plan_layout(layout))

    def host_lease(
        self,
        model: LoadedModel,
        plan: RankPlan,
        *,
        wait: bool = True,
        remember: bool = False,
        build: Callable[[], HostPack] | None = None,
        declared: bool = False,
    ) -> Lease[HostPack]:
        """A lease on ``model``'s pack for ``plan``'s layout, built (by ``build``) if absent.

        ``wait=False``: a pack not built yet raises :class:`PackPending` at once (its
        build started, if it had not), after logging ``pack_pending``, so the worker
        fetches over gRPC meanwhile. ``remember``: record the layout's deployment in
        the cache directory, for the next start to build (:mod:`.layout_memory`). A
        build whose bytes do not match the verified digests marks the model broken:
        it serves nothing (DATA_LOSS) until reloaded.
        """
        layout = plan.layout
        label = f"{model.name}:{pack_label(layout)}"
        make = build or (lambda: build_host_pack(model, plan, f"weightd:{label}"))

        def build_it() -> HostPack:
            started = time.monotonic()
            try:
                pack = make()
            except DataIntegrityError as exc:
                self.weights.mark_broken(model, exc)
                raise
            if self.pinner is not None:
                self.pinner.pin(pack)
            seconds = time.monotonic() - started
            logs.event(
                "pack_built",
                model=model.name,
                layout=pack_label(layout),
                tensors=len(pack.entries),
                bytes=pack.size,
                seconds=seconds,
                pinned=pack.pinned,
                declared=declared,
            )
            if remember and self.memory is not None:
                self.memory.remember(model.name, LayoutGroup.of(layout))
            return pack

        def pending(started: bool) -> None:
            logs.event(
                "pack_pending",
                model=model.name,
                layout=pack_label(layout),
                build="started" if started else "running",
            )

        def size() -> int:
            return layout_pack(plan.slices)[1]

        info = PackInfo(model.name, layout, lpb.PLACEMENT_HOST, declared=declared)
        lease = self.host.acquire(
            key_of(model, layout), size, info, build_it, wait=wait, on_pending=pending
        )
        if remember and self.memory is not None:  # asked again: remembered as recent
            self.memory.remember(model.name, LayoutGroup.of(layout))
        return lease

    def _acquire_adapter(self, req: lpb.AcquirePack) -> Outcome:
        """The current version of adapter ``req.adapter``: its pack, leased, the version held."""
        held: Held = self._adapter_lease(req)
        return answer(self.boot_id, held, [], list(req.slice_digests))

    def _adapter_lease(self, req: lpb.AcquirePack) -> AdapterPackLease:
        """``req``'s adapter pack, leased, with its version held (see :meth:`_acquire_adapter`)."""
        if self.adapters is None:
            raise NoAdapters("this daemon serves no adapters")
        if req.model or req.names:
            raise LocalProtocolError(
                "an adapter pack request names the adapter only (no model, no tensor names)"
            )
        layout = Layout.of(req.layout)
        check_tp_only(layout)
        adapters = self.adapters
        ws, rank = req.layout.tp_size, req.layout.tp_rank
        registry = adapters.registry
        if req.adapter_version:  # the version an engine was given, while it is held
            version = registry.hold_version(req.adapter, req.adapter_version)
        else:
            version = registry.hold(req.adapter)
        try:
            v = version.version
            plan = adapters.plan(v, layout)
            key = adapter_key(v.name, v.version, ws, rank)
            label = f"adapter:{v.name}:v{v.version}:tp{ws}:r{rank}"

            def build() -> HostPack:
                pack = build_adapter_pack(v, plan, f"weightd:{label}")
                if self.pinner is not None:
                    self.pinner.pin(pack)
                log.info("built pack %s: %d tensors, %d bytes", label, len(pack.entries), pack.size)
                return pack

            _, size = layout_pack(plan.slices)
            tag = adapter_tag(v, plan)
            info = PackInfo(v.adapter.base_model, layout, lpb.PLACEMENT_HOST, adapter=tag)
            host = self.host.acquire(key, size, info, build)
            lease: Lease[HostPack] | Lease[CudaPack] = host
            if req.placement not in (lpb.PLACEMENT_HOST, lpb.PLACEMENT_UNSPECIFIED):
                lease = self._place(req, host, key, info)
        except BaseException as error:
            release_frames(error)
            version.release()
            raise
        return AdapterPackLease(lease, version)

    def _place(
        self, req: lpb.AcquirePack, host: Lease[HostPack], key: Hashable, info: PackInfo
    ) -> Lease[CudaPack]:
        """A lease on the GPU copy of ``host``'s pack; ``host`` is released either way."""
        try:
            if req.placement != lpb.PLACEMENT_CUDA:
                raise LocalProtocolError(f"placement {req.placement} is not known")
            cache = self.gpu.get(req.gpu_uuid)
            if self.placer is None or cache is None:
                offered = sorted(self.gpu) if self.placer else "none: started without --cuda-ipc"
                raise PlacementUnavailable(
                    f"the daemon cannot place packs on GPU {req.gpu_uuid or '(none named)'} "
                    f"(GPUs it places on: {offered})"
                )
            placer = self.placer
            gpu_info = replace(info, placement=lpb.PLACEMENT_CUDA, gpu_uuid=req.gpu_uuid)
            return cache.acquire(
                key, host.pack.size, gpu_info, lambda: placer.place(host.pack, req.gpu_uuid)
            )
        finally:
            host.release()  # the GPU copy stands alone; the host pack ages out by its TTL

    def _attach(self, req: lpb.AttachPack) -> Outcome:
        if req.boot_id != self.boot_id:
            raise StaleGrant(
                f"pack {req.pack_id} was granted by daemon boot {req.boot_id or '(none)'}; "
                f"this daemon is boot {self.boot_id} (it restarted since): fetch again"
            )
        lease: Lease[HostPack] | Lease[CudaPack] | None = None
        for cache in self._caches():
            try:
                lease = cache.attach(req.pack_id)
                break
            except StaleGrant:
                continue
        if lease is None:
            raise StaleGrant(f"pack {req.pack_id} does not exist (any more) in this daemon")
        known = {e.name for e in lease.pack.entries}
        missing = [n for n in req.names if n not in known]
        if missing:
            lease.release()
            raise LocalProtocolError(f"pack {req.pack_id} holds no tensor {missing[0]!r}")
        info = lease.info
        assert isinstance(info, PackInfo)
        kinds = list(req.slice_digests)
        if info.adapter is None:
            state, reason = self.weights.registry.state(info.model)
            if state == "broken":  # a build (or a check) found its bytes changed
                lease.release()
                raise DataIntegrityError(
                    f"pack {req.pack_id}: model {info.model!r} is not served until reloaded: "
                    f"{reason}"
                )
        if info.adapter is None or self.adapters is None:
            return answer(self.boot_id, lease, list(req.names), kinds)
        tag = info.adapter
        try:
            version = self.adapters.registry.hold_version(tag.name, tag.version)
        except AdapterNotFound:
            lease.release()
            self._adapter_dropped(tag.name, tag.version)  # dropped while we attached
            raise StaleGrant(
                f"pack {req.pack_id} holds version {tag.version} of adapter {tag.name!r}, "
                "which is no longer held: fetch again"
            ) from None
        held: Held = AdapterPackLease(lease, version)
        return answer(self.boot_id, held, list(req.names), kinds)

    # --- upkeep ----------------------------------------------------------------------------

    def stats(self) -> lpb.LocalStats:
        out = lpb.LocalStats(
            host_bytes=self.host.used_bytes,
            host_budget_bytes=self.host.budget_bytes,
            pinned_bytes=self.pinner.pinned_bytes if self.pinner else 0,
            pin_budget_bytes=self.pinner.budget_bytes if self.pinner else 0,
            cuda_bytes=sum(c.used_bytes for c in self.gpu.values()),
            cuda_budget_bytes=sum(c.budget_bytes for c in self.gpu.values()),
            connections=self.connections(),
        )
        own = self._own()
        for cache in self._caches():
            out.builds_total += cache.builds_total
            out.evictions_total += cache.evictions_total
            for s in cache.states():
                held = own[s.pack_id] if cache is self.host else 0
                info = s.info
                assert isinstance(info, PackInfo)
                out.packs.add(
                    pack_id=s.pack_id,
                    model=info.model,
                    layout=wire_layout(info.layout),
                    placement=info.placement,
                    gpu_uuid=info.gpu_uuid,
                    size_bytes=s.size,
                    leases=s.leases - held,  # workers' (the daemon's own: ``declared``)
                    idle_seconds=s.idle_seconds,
                    pinned=isinstance(s.pack, HostPack) and s.pack.pinned,
                    adapter=info.adapter.name if info.adapter else "",
                    adapter_version=info.adapter.version if info.adapter else 0,
                    building=s.building,
                    declared=held > 0,
                )
        return out

    def reap(self) -> None:
        for cache in self._caches():
            cache.reap()

    def close(self) -> None:
        for cache in reversed(self._caches()):
            cache.close()
