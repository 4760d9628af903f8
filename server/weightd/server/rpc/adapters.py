"""The adapter RPCs: admin (load, unload, list, pin) and worker (fetch a rank's slices, watch).

Thin, like the Weights servicer: messages are converted to calls on the adapter domain
(:class:`~weightd.server.adapters.service.AdapterService`), which checks names, verifies
and plans; the bytes stream here in ``Fetch``'s chunk format. Slice digests are SHA-256
of bytes cut from the in-memory copy the load verified (BLAKE3 per tensor), so they are
anchored by construction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Final

import grpc

from weightd.v1 import weightd_pb2 as pb

from ..adapters.load import CONFIG_FILE, WEIGHTS_FILE
from ..adapters.packing import slice_bytes
from ..adapters.registry import AdapterEvent, AdapterHold, AdapterVersion
from ..adapters.service import AdapterService, AdapterState, check_name
from ..weights.layouts import Layout
from .status import abort
from .watches import watch_stream
from .wire import chunk_bytes, slice_header

log = logging.getLogger("weightd.adapters")

_KINDS: Final = {
    "load": pb.AdapterEvent.LOAD,
    "replace": pb.AdapterEvent.REPLACE,
    "unload": pb.AdapterEvent.UNLOAD,
}


def status(v: AdapterVersion, pinned: bool = False, holds: int = 0) -> pb.AdapterStatus:
    return pb.AdapterStatus(
        name=v.name,
        version=v.version,
        digest=v.adapter.digest,
        base_model=v.adapter.base_model,
        nbytes=v.adapter.nbytes,
        pinned=pinned,
        leases=holds,  # the field predates the word: holds on the version
        source_dir=v.adapter.source,
    )


def _status_of(name: str, state: AdapterState | None) -> pb.AdapterStatus:
    if state is None:
        return pb.AdapterStatus(name=name)
    return status(state.version, state.pinned, state.holds)


class Adapters:
    """The adapter RPCs' handlers over the domain service; ends watch streams on close."""

    def __init__(self, service: AdapterService) -> None:
        self.service = service
        self._stop = threading.Event()

    def close(self) -> None:
        """Ends every watch stream (daemon shutdown)."""
        self._stop.set()

    # --- admin --------------------------------------------------------------------

    def load(self, request: pb.LoadAdapterRequest) -> pb.AdapterStatus:
        state = self.service.load(
            request.name, request.model, request.source_dir, request.expected_digest
        )
        return _status_of(request.name, state)

    def unload(self, request: pb.AdapterNameRequest) -> pb.AdapterStatus:
        return status(self.service.unload(request.name))

    def pin(self, request: pb.AdapterNameRequest, pinned: bool) -> pb.AdapterStatus:
        return _status_of(request.name, self.service.set_pinned(request.name, pinned))

    def list(self) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(
            adapters=[status(s.version, s.pinned, s.holds) for s in self.service.current()]
        )

    # --- worker -------------------------------------------------------------------

    def fetch(
        self, request: pb.FetchAdapterRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchResponse]:
        try:
            check_name(request.name)
            layout = Layout.of(request.layout)
            hold = self.service.registry.hold(request.name)
        except Exception as exc:
            abort(context, exc, "FetchAdapter")
        try:
            yield from self._stream(hold.version, layout, request, context)
        except Exception as exc:
            if context.is_active():
                abort(context, exc, "FetchAdapter")
        finally:
            hold.release()  # also on cancellation (GeneratorExit at a yield)

    def _stream(
        self,
        v: AdapterVersion,
        layout: Layout,
        request: pb.FetchAdapterRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[pb.FetchResponse]:
        plan = self.service.plan(v, layout)
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
            header = slice_header(s)
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

    def resolve(self, request: pb.ResolveAdapterRequest) -> pb.AdapterStatus:
        s = self.service.resolve(request.name, request.model, request.load)
        return status(s.version, s.pinned, s.holds)

    def fetch_files(
        self, request: pb.FetchAdapterFilesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.AdapterFileChunk]:
        """Both files of one version, as verified, under a hold on that version."""
        try:
            check_name(request.name)
            registry = self.service.registry
            hold: AdapterHold = (
                registry.hold_version(request.name, request.version)
                if request.version
                else registry.hold(request.name)
            )
        except Exception as exc:
            abort(context, exc, "FetchAdapterFiles")
        try:
            v = hold.version
            chunk = chunk_bytes(request.max_chunk_bytes)
            first = True
            files = ((CONFIG_FILE, v.adapter.config_data), (WEIGHTS_FILE, v.adapter.data))
            for file, data in files:
                view = memoryview(data)
                for offset in range(0, max(len(data), 1), chunk):
                    if not context.is_active():
                        return
                    piece = bytes(view[offset : offset + chunk])
                    msg = pb.AdapterFileChunk(file=file, size=len(data), offset=offset, data=piece)
                    if first:
                        msg.adapter.CopyFrom(status(v))
                        first = False
                    yield msg
        except Exception as exc:
            if context.is_active():
                abort(context, exc, "FetchAdapterFiles")
        finally:
            hold.release()  # also on cancellation (GeneratorExit at a yield)

    def watch(self, context: grpc.ServicerContext) -> Iterator[pb.AdapterEvent]:
        w = self.service.registry.watch()
        return watch_stream(w, context, self._stop, to_pb, "WatchAdapters", "adapter")


def to_pb(e: AdapterEvent) -> pb.AdapterEvent:
    return pb.AdapterEvent(
        kind=_KINDS[e.kind], name=e.name, version=e.version, digest=e.digest, reason=e.reason
    )
