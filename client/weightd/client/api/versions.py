"""Model versions as the client sees them: the watch stream and holds.

A daemon numbers each new content of a model (a reload, a trainer's ``Publish``) and
announces it READY on ``WatchVersions``; an engine moves to it by fetching with
``version=N``. While its ranks fetch, a :class:`VersionHold` keeps that version in the
daemon even if a newer one is published meanwhile (released with ``with``, or when
its TTL passes if the holder dies).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc

from weightd.common.watch import EventStream
from weightd.v1 import weightd_pb2 as pb

from ..base.errors import WeightdError, from_rpc_error, watch_failed

log = logging.getLogger("weightd.client")

_KINDS = {pb.VersionEvent.READY: "ready", pb.VersionEvent.DROPPED: "dropped"}


@dataclass(frozen=True)
class VersionInfo:
    """One version of a model (``weightd.v1.VersionInfo``)."""

    model: str
    version: int
    fingerprint: str
    total_bytes: int
    num_tensors: int
    architecture: str
    source: str


def version_of(v: pb.VersionInfo) -> VersionInfo:
    return VersionInfo(
        v.model,
        v.version,
        v.model_fingerprint,
        v.total_bytes,
        v.num_tensors,
        v.architecture,
        v.source,
    )


@dataclass(frozen=True)
class VersionEvent:
    """``kind`` is "ready" (engines may move to it) or "dropped" (no longer fetchable)."""

    kind: str
    info: VersionInfo


class VersionWatch(EventStream[pb.VersionEvent, VersionEvent]):
    """An iterator of :class:`VersionEvent`; ``close()`` (or ``with``) ends the stream.

    First the current version of every model (or of the one watched) as "ready", then
    each change in the order the daemon made it.
    """

    def __init__(self, stub: Any, model: str, timeout: float | None) -> None:
        call = stub.WatchVersions(pb.WatchVersionsRequest(model=model), timeout=timeout)
        super().__init__(call, _event, watch_failed)


def _event(e: pb.VersionEvent) -> VersionEvent:
    return VersionEvent(_KINDS.get(e.kind, "unknown"), version_of(e.version))


class VersionHold:
    """A version kept in the daemon until :meth:`release` (or ``with`` ends) or its TTL.

    Releasing is best effort: if the daemon cannot be reached the hold simply expires.
    """

    def __init__(self, stub: Any, reply: pb.HoldVersionResponse, timeout: float | None) -> None:
        self._stub = stub
        self._timeout = timeout
        self.hold_id = reply.hold_id
        self.info = version_of(reply.version)
        self.ttl_seconds = reply.ttl_seconds
        self.released = False

    @property
    def version(self) -> int:
        """The version number held."""
        return self.info.version

    def release(self) -> bool:
        """End the hold; False when the daemon no longer had it (expired) or was unreachable."""
        if self.released:
            return False
        self.released = True
        try:
            reply = self._stub.ReleaseVersion(
                pb.ReleaseVersionRequest(hold_id=self.hold_id), timeout=self._timeout or 30
            )
        except grpc.RpcError as exc:
            err: WeightdError = from_rpc_error(exc)
            log.warning(
                "weightd: release of the hold on %s version %d failed (it expires by "
                "itself within %.0fs): %s",
                self.info.model,
                self.info.version,
                self.ttl_seconds,
                err,
            )
            return False
        return bool(reply.released)

    def __enter__(self) -> VersionHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
