"""The adapter RPCs: admin (load, unload, list, pin) and worker (fetch a rank's slices, watch).

Thin, like ``service``: requests are resolved against the model and adapter registries,
the pure planner says which bytes, and the bytes stream in ``Fetch``'s chunk format.
Slice digests are SHA-256 of bytes cut from the in-memory copy the load verified
(BLAKE3 per tensor), so they are anchored by construction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Final

import grpc

from weightd.v1 import weightd_pb2 as pb

from ..adapters.collector import AdapterMetrics
from ..adapters.load import load_adapter
from ..adapters.packing import slice_bytes
from ..adapters.plan import AdapterSlicePlan, plan_adapter
from ..adapters.registry import AdapterEvent, AdapterRegistry, AdapterVersion
from ..base.errors import InvalidRequest, status_for
from ..registry.models import ModelRegistry
from .wire import chunk_bytes

log = logging.getLogger("weightd.adapters")

_KINDS: Final = {
    "load": pb.AdapterEvent.LOAD,
    "replace": pb.AdapterEvent.REPLACE,
    "unload": pb.AdapterEvent.UNLOAD,
}
#: Seconds between checks that a watcher is still connected.
WATCH_POLL_SECONDS: Final = 1.0
MAX_ADAPTER_NAME_BYTES: Final = 256


def _abort(context: grpc.ServicerContext, error: BaseException, method: str) -> None:
    code, detail = status_for(error)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=error)
    context.abort(code, detail)


def _check_name(name: str) -> None:
    if not name:
        raise InvalidRequest("adapter name is empty")
    if len(name.encode()) > MAX_ADAPTER_NAME_BYTES or not name.isprintable():
        raise InvalidRequest(
            f"adapter name {name[:64]!r} must be printable and at most "
            f"{MAX_ADAPTER_NAME_BYTES} bytes"
        )


class Adapters:
    """Everything the adapter RPCs need: the registries and the configured roots."""

    def __init__(
        self, models: ModelRegistry, registry: AdapterRegistry, roots: Sequence[str]
    ) -> None:
        self.models = models
        self.registry = registry
        self.roots = tuple(roots)
        self._stop = threading.Event()
        #: Load latency and rejections, when the daemon exports metrics.
        self.metrics: AdapterMetrics | None = None

    def close(self) -> None:
        """Ends every watch stream (daemon shutdown)."""
        self._stop.set()

    # --- admin --------------------------------------------------------------------

    def status(self, v: AdapterVersion, pinned: bool = False, leases: int = 0) -> pb.AdapterStatus:
        return pb.AdapterStatus(
            name=v.name,
            version=v.version,
            digest=v.adapter.digest,
            base_model=v.adapter.base_model,
            nbytes=v.adapter.nbytes,
            pinned=pinned,
            leases=leases,
            source_dir=v.adapter.source,
        )

    def _current(self, name: str) -> pb.AdapterStatus:
        for v, pinned, leases in self.registry.current():
            if v.name == name:
                return self.status(v, pinned, leases)
        return pb.AdapterStatus(name=name)

    def load(self, request: pb.LoadAdapterRequest) -> pb.AdapterStatus:
        started = time.monotonic()
        try:
            status = self._load(request)
        except Exception as exc:
            if self.metrics is not None:
                self.metrics.rejected(exc)
            raise
        if self.metrics is not None:
            self.metrics.published(time.monotonic() - started)
        return status

    def _load(self, request: pb.LoadAdapterRequest) -> pb.AdapterStatus:
        _check_name(request.name)
        if not request.source_dir:
            raise InvalidRequest("source_dir is empty")
        base = self.models.get(request.model).checkpoint
        expected = request.expected_digest or None
        roots = self.roots
        self.registry.load(
            request.name,
            f"{base.name}\0{request.source_dir}",
            expected,
            lambda: load_adapter(request.source_dir, roots, base, expected),
        )
        return self._current(request.name)

    def unload(self, request: pb.AdapterNameRequest) -> pb.AdapterStatus:
        _check_name(request.name)
        return self.status(self.registry.unload(request.name))

    def pin(self, request: pb.AdapterNameRequest, pinned: bool) -> pb.AdapterStatus:
        _check_name(request.name)
        self.registry.set_pinned(request.name, pinned)
        return self._current(request.name)

    def list(self) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(
            adapters=[self.status(v, p, n) for v, p, n in self.registry.current()]
        )

    # --- worker -------------------------------------------------------------------

    def plan(self, v: AdapterVersion, world_size: int, rank: int) -> AdapterSlicePlan:
        """Which slices of version ``v`` rank ``rank`` of ``world_size`` receives."""
        model = self.models.get(v.adapter.base_model)
        return plan_adapter(v.adapter.modules, model.checkpoint, model.rules, world_size, rank)

    def fetch(
        self, request: pb.FetchAdapterRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchResponse]:
        try:
            _check_name(request.name)
            check_tp_only(request.layout)
            lease = self.registry.lease(request.name)
        except Exception as exc:
            _abort(context, exc, "FetchAdapter")
            return
        try:
            yield from self._stream(lease.version, request, context)
        except Exception as exc:
            if context.is_active():
                _abort(context, exc, "FetchAdapter")
        finally:
            lease.release()  # also on cancellation (GeneratorExit at a yield)

    def _stream(
        self, v: AdapterVersion, request: pb.FetchAdapterRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchResponse]:
        plan = self.plan(v, request.layout.tp_size, request.layout.tp_rank)
        chunk = chunk_bytes(request.max_chunk_bytes)
        info = pb.AdapterInfo(
            name=v.name,
            version=v.version,
            digest=v.adapter.digest,
            base_model=v.adapter.base_model,
            scaling=plan.scaling,
        )
        pending: list[pb.TensorChunk] = []
        pending_bytes = 0
        first = True
        for index, s in enumerate(plan.slices):
            if not context.is_active():
                return
            data, digest = slice_bytes(v, s)
            header = pb.SliceHeader(
                name=s.name,
                dtype=s.dtype,
                shape=s.shape,
                nbytes=s.nbytes,
                split_dim=s.split_dim,
                replicated=s.replicated,
            )
            offsets = range(0, max(len(data), 1), chunk)
            for offset in offsets:
                part = data[offset : offset + chunk]
                piece = pb.TensorChunk(index=index, offset=offset, data=part)
                if offset == 0:
                    piece.header.CopyFrom(header)
                if offset + len(part) == s.nbytes:
                    piece.digest = digest
                if pending and pending_bytes + len(part) > chunk:
                    msg = pb.FetchResponse(chunks=pending)
                    if first:
                        msg.adapter.CopyFrom(info)
                        first = False
                    yield msg
                    pending, pending_bytes = [], 0
                pending.append(piece)
                pending_bytes += len(part)
        last = pb.FetchResponse(
            chunks=pending,
            done=pb.FetchDone(num_tensors=len(plan.slices), total_bytes=plan.nbytes),
        )
        if first:
            last.adapter.CopyFrom(info)
        yield last

    def watch(self, context: grpc.ServicerContext) -> Iterator[pb.AdapterEvent]:
        w = self.registry.watch()
        try:
            while context.is_active() and not self._stop.is_set():
                event = w.next(timeout=WATCH_POLL_SECONDS)
                if event is None:
                    if w.overflowed:
                        context.abort(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            "watcher fell too far behind the adapter events; watch again",
                        )
                    continue
                yield to_pb(event)
        finally:
            w.close()


def check_tp_only(layout: pb.Layout) -> None:
    if layout.pp_size > 1 or layout.ep_size > 1:
        raise InvalidRequest("adapters are served for tensor parallelism only")


def to_pb(e: AdapterEvent) -> pb.AdapterEvent:
    return pb.AdapterEvent(
        kind=_KINDS[e.kind], name=e.name, version=e.version, digest=e.digest, reason=e.reason
    )
