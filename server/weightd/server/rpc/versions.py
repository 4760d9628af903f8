"""The version RPCs: WatchVersions, HoldVersion, ReleaseVersion (worker), Publish (admin).

Thin, like the other servicers: messages become calls on
:class:`~weightd.server.registry.versions.ModelVersions` and
:class:`~weightd.server.registry.publish.Publisher`; errors become statuses in
:mod:`.status`.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Final, TypeVar

import grpc

from weightd.v1 import weightd_pb2 as pb

from ..base.errors import InvalidRequest, PublishAborted
from ..weights.models import ModelVersions, Published, Publisher, VersionEvent, VersionInfo
from .peers import client_of
from .watches import watch_stream

#: The most data bytes one PublishTensors chunk carries (gRPC's message limit is set
#: to this plus room for the rest of the message on the admin listener).
MAX_PUBLISH_CHUNK_BYTES: Final = 4 << 20
T = TypeVar("T")
_KINDS: Final = {"ready": pb.VersionEvent.READY, "dropped": pb.VersionEvent.DROPPED}


def version_pb(info: VersionInfo) -> pb.VersionInfo:
    return pb.VersionInfo(
        model=info.model,
        version=info.version,
        model_fingerprint=info.fingerprint,
        total_bytes=info.total_bytes,
        num_tensors=info.num_tensors,
        architecture=info.architecture,
        source=info.source,
    )


def event_pb(event: VersionEvent) -> pb.VersionEvent:
    return pb.VersionEvent(kind=_KINDS[event.kind], version=version_pb(event.info))


def published_pb(p: Published) -> pb.PublishResponse:
    return pb.PublishResponse(
        version=version_pb(VersionInfo.of(p.model)),
        verify_seconds=p.verify_seconds,
        prepare_seconds=p.prepared.seconds,
        packs_built=p.prepared.packs_built,
    )


#: Seconds a PublishTensors stream may go without sending a chunk before the daemon
#: gives up on it (nothing published, its memfd closed, the admin thread free again).
CHUNK_IDLE_SECONDS: Final = 60.0
_END: Final = object()


def paced_chunks(chunks: Iterator[T], idle_seconds: float) -> Iterator[T]:
    """``chunks`` (a request stream), each awaited at most ``idle_seconds``: gRPC's
    request iterator blocks without a timeout, so a reader thread feeds a queue of two
    (at most two chunks held) and a stalled or broken stream becomes
    :class:`PublishAborted` here. When this generator ends early the reader stops at its
    next chunk (or when gRPC ends the call, which ends its wait)."""
    q: queue.Queue[object] = queue.Queue(maxsize=2)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=1.0)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for chunk in chunks:
                if not put(chunk):
                    return
            put(_END)
        except Exception as exc:  # grpc.RpcError: the stream broke
            put(exc)

    threading.Thread(target=read, name="weightd-publish-stream", daemon=True).start()
    try:
        while True:
            try:
                item = q.get(timeout=idle_seconds)
            except queue.Empty:
                raise PublishAborted(
                    f"the PublishTensors stream sent nothing for {idle_seconds:g} s: nothing "
                    "was published"
                ) from None
            if item is _END:
                return
            if isinstance(item, Exception):
                raise PublishAborted(
                    "the PublishTensors stream broke before all its bytes arrived: nothing "
                    "was published"
                ) from None
            yield item  # type: ignore[misc]  # a chunk: not _END, not an exception
    finally:
        stop.set()


class Versions:
    """The version RPCs' handlers; ends watch streams on close."""

    def __init__(self, versions: ModelVersions, publisher: Publisher | None = None) -> None:
        self.versions = versions
        self.publisher = publisher
        self._stop = threading.Event()

    def close(self) -> None:
        self._stop.set()
        self.versions.close()

    def hold(
        self, request: pb.HoldVersionRequest, context: grpc.ServicerContext
    ) -> pb.HoldVersionResponse:
        hold, info = self.versions.hold(
            request.model,
            request.version,
            request.holder,
            float(request.ttl_seconds),
            client_of(context),
        )
        return pb.HoldVersionResponse(
            hold_id=hold.hold_id, version=version_pb(info), ttl_seconds=hold.ttl
        )

    def release(self, request: pb.ReleaseVersionRequest) -> pb.ReleaseVersionResponse:
        return pb.ReleaseVersionResponse(released=self.versions.release(request.hold_id))

    def publish(self, request: pb.PublishRequest) -> pb.PublishResponse:
        if self.publisher is None:
            raise InvalidRequest("this daemon publishes no versions")
        return published_pb(self.publisher.publish(request.model, request.source, request.manifest))

    def publish_tensors(
        self, chunks: Iterator[pb.PublishTensorsChunk], context: grpc.ServicerContext
    ) -> pb.PublishResponse:
        """PublishTensors: the first chunk names the model and the size; the bytes go
        into a memfd the daemon seals (:meth:`Publisher.publish_chunks`). A stream that
        breaks, or a caller gone before the commit, publishes nothing."""
        if self.publisher is None:
            raise InvalidRequest("this daemon publishes no versions")
        paced = paced_chunks(chunks, CHUNK_IDLE_SECONDS)
        first = next(paced, None)
        if first is None:
            raise InvalidRequest("PublishTensors: the stream sent no chunk")

        def data() -> Iterator[bytes]:
            yield first.data
            for chunk in paced:
                if chunk.model or chunk.total_bytes:
                    raise InvalidRequest(
                        "PublishTensors: only the first chunk names the model and the size"
                    )
                yield chunk.data

        def still_wanted() -> None:
            if not context.is_active():
                raise PublishAborted(
                    "the PublishTensors caller went away before the version was committed: "
                    "nothing was published"
                )

        published = self.publisher.publish_chunks(
            first.model, first.total_bytes, data(), still_wanted
        )
        return published_pb(published)

    def watch(
        self, request: pb.WatchVersionsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.VersionEvent]:
        w = self.versions.watch(request.model)
        return watch_stream(w, context, self._stop, event_pb, "WatchVersions", "version")
