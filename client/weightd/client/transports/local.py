"""The client end of the daemon's side socket: one connection, one request, one lease.

The daemon greets every connection with a :class:`LocalHello` (boot id, what it can
place where); the client sends one request and reads one answer (with the pack's
memfd for a host pack). If the answer grants a lease, the connection *is* the
lease: it stays open until :meth:`LocalConnection.close`, which the shm and CUDA
IPC modules call when the last tensor viewing the pack is freed, or until the
process dies, when the kernel closes it for us.

Failures of the channel itself (no socket, a refused or broken connection, a
malformed frame) are :class:`~weightd.client.base.errors.UnavailableError` marked with
the transport's name, so ``transport="auto"`` can report them and fall back.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING, Final, Protocol

from weightd.common.frames import MAX_REQUEST_FRAME_BYTES, FrameError, recv_frame, send_frame

from ..base.errors import (
    MAX_FIELDS,
    ResourceExhaustedError,
    UnavailableError,
    WeightdError,
    error_for,
)
from ..receive.hashers import available_kinds
from .localwire import (
    PLACEMENT_CUDA,
    Error,
    Grant,
    Hello,
    Response,
    WireError,
    decode_hello,
    decode_response,
)
from .localwire import encode_attach as _encode_attach
from .selection import AdapterRef, PackRef

if TYPE_CHECKING:
    from weightd.v1 import local_pb2 as lpb
    from weightd.v1 import weightd_pb2 as pb


class _Message(Protocol):
    """A generated message (tests and tools send those; a fetch sends bytes)."""

    def SerializeToString(self) -> bytes: ...


#: Connecting and reading the hello take no longer than this.
CONNECT_TIMEOUT_SECONDS: Final = 10.0


class LocalConnection:
    """A connection to ``path``; ``transport`` names the transport using it, for errors."""

    def __init__(self, path: str, transport: str, timeout: float | None = None) -> None:
        self.path = path
        self.transport = transport
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC
        )
        try:
            self._sock.settimeout(CONNECT_TIMEOUT_SECONDS)
            self._sock.connect(path)
            self.hello = self._greeting()
        except BaseException:
            self.close()
            raise

    def _greeting(self) -> Hello:
        """The daemon's hello; its refusal (every slot taken) raised as the daemon's error."""
        payload = self._recv(0)[0]
        try:
            hello = decode_hello(payload)
        except WireError as exc:
            raise self._broken("decoding the hello", exc) from None
        if hello.refused is not None:
            err = hello.refused
            raise local_error(err, self.transport)
        return hello

    def _broken(self, what: str, exc: BaseException) -> WeightdError:
        return UnavailableError(f"side socket {self.path}: {what}: {exc}", transport=self.transport)

    def _recv(self, max_fds: int) -> tuple[bytes, list[int]]:
        assert self._sock is not None
        try:
            got = recv_frame(self._sock, max_fds)
        except (OSError, FrameError) as exc:
            raise self._broken("receiving", exc) from None
        if got is None:
            raise self._broken("receiving", ConnectionError("the daemon closed the connection"))
        return got

    def request(self, request: bytes | _Message, max_fds: int = 0) -> tuple[Grant, list[int]]:
        """Send ``request`` (a ``LocalRequest``: its wire bytes, or the message); the
        grant and the descriptors that came with it (the caller owns them)."""
        response, fds = self.exchange(request, max_fds)
        if response.grant is None:
            for fd in fds:
                os.close(fd)
            raise self._broken("answer", ValueError("expected a pack grant"))
        return response.grant, fds

    def exchange(self, request: bytes | _Message, max_fds: int = 0) -> tuple[Response, list[int]]:
        if self._sock is None:
            raise self._broken("sending", ConnectionError("connection already closed"))
        payload = request if isinstance(request, bytes) else request.SerializeToString()
        if len(payload) > MAX_REQUEST_FRAME_BYTES:  # the daemon would hang up unread
            raise ResourceExhaustedError(
                f"side-channel request is {len(payload)} bytes; the daemon reads at most "
                f"{MAX_REQUEST_FRAME_BYTES} (ask for fewer names per request)"
            )
        try:
            self._sock.settimeout(self.timeout)
            send_frame(self._sock, payload)
        except (OSError, FrameError) as exc:
            raise self._broken("sending", exc) from None
        payload, fds = self._recv(max_fds)
        try:
            response = decode_response(payload)
        except WireError as exc:
            for fd in fds:
                os.close(fd)
            raise self._broken("decoding the answer", exc) from None
        if response.error is not None:
            for fd in fds:
                os.close(fd)
            err = response.error
            # A pending pack arrives as reason PackPending (PackPendingError): every daemon
            # that sends ``pending`` sends its reason too.
            raise local_error(err, self.transport)
        return response, fds

    def close(self) -> None:
        """End the lease (if any). Idempotent and safe from any thread, finalizers included."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def local_error(err: Error, transport: str) -> WeightdError:
    """The typed error for a side-channel refusal: by its reason and fields where the
    daemon sent them (as gRPC's rich status carries them), else by code."""
    return error_for(
        err.code,
        err.detail,
        transport=transport if err.transport else None,
        reason=err.reason,
        metadata=dict(list(err.metadata.items())[:MAX_FIELDS]),
    )


def pack_ref(grant: Grant) -> PackRef:
    adapter = None
    if grant.adapter is not None:  # an adapter pack: its AdapterInfo, parsed by protobuf
        from weightd.v1 import weightd_pb2 as pb

        adapter = adapter_ref(pb.AdapterInfo.FromString(grant.adapter))
    return PackRef(
        boot_id=grant.boot_id,
        pack_id=grant.pack_id,
        model=grant.model,
        tp_size=grant.layout.tp_size,
        tp_rank=grant.layout.tp_rank,
        placement="cuda" if grant.placement == PLACEMENT_CUDA else "host",
        size_bytes=grant.size_bytes,
        gpu_uuid=grant.gpu_uuid,
        pinned=grant.pinned,
        built=grant.built,
        adapter=adapter,
    )


def adapter_ref(info: pb.AdapterInfo) -> AdapterRef:
    return AdapterRef(
        info.name, info.version, info.digest, info.base_model, tuple(sorted(info.scaling.items()))
    )


def attach_request(ref: PackRef, names: list[str]) -> bytes:
    return _encode_attach(
        boot_id=ref.boot_id,
        pack_id=ref.pack_id,
        names=names,
        slice_digests=list(available_kinds()),
    )


def local_stats(path: str, timeout: float | None = 30.0) -> lpb.LocalStats:
    """The daemon's pack table and budgets (for operators and tests)."""
    from weightd.v1 import local_pb2 as lpb

    conn = LocalConnection(path, "shm", timeout)
    try:
        response, _ = conn.exchange(lpb.LocalRequest(stats=lpb.PackStatsRequest()))
        if response.stats is None:
            raise conn._broken("answer", ValueError("expected the pack stats"))
        return lpb.LocalStats.FromString(response.stats)
    finally:
        conn.close()
