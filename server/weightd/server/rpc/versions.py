"""The version RPCs: WatchVersions, HoldVersion, ReleaseVersion (worker), Publish (admin).

Thin, like the other servicers: messages become calls on
:class:`~weightd.server.registry.versions.ModelVersions` and
:class:`~weightd.server.registry.publish.Publisher`; errors become statuses in
:mod:`.status`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Final

import grpc

from weightd.v1 import weightd_pb2 as pb

from ..base.errors import InvalidRequest, WatchOverflow
from ..registry.publish import Published, Publisher
from ..registry.versions import ModelVersions, VersionEvent, VersionInfo
from .peers import client_of
from .status import abort

#: Seconds between checks that a watcher is still connected (and holds' expiry).
WATCH_POLL_SECONDS: Final = 1.0

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

    def watch(
        self, request: pb.WatchVersionsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.VersionEvent]:
        w = self.versions.watch(request.model)
        try:
            while context.is_active() and not self._stop.is_set():
                event = w.next(timeout=WATCH_POLL_SECONDS)
                if event is None:
                    if w.overflowed:
                        abort(
                            context,
                            WatchOverflow(
                                "watcher fell too far behind the version events; watch again"
                            ),
                            "WatchVersions",
                        )
                    continue
                yield event_pb(event)
        finally:
            w.close()
