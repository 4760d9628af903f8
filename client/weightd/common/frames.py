"""Length-prefixed frames on a Unix stream socket, optionally carrying file descriptors.

Both ends of the same-host side channel (``proto/weightd/v1/local.proto``) speak
this: a 4-byte big-endian length, then the payload (one serialized message). A
frame may carry descriptors as ``SCM_RIGHTS`` ancillary data; they ride with its
first byte, so the receiver reads the 4-byte length with ``recvmsg`` and the rest
with plain reads, never reading past the frame.

Unlike the rest of ``weightd.common`` this does I/O; it lives here because it needs
only the standard library, so the client (grpcio, protobuf and torch only) and the
daemon share one implementation.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Final

#: Largest frame either side accepts. A pack table for 100k tensors is ~15 MB.
MAX_FRAME_BYTES: Final = 64 << 20
#: Largest frame the daemon reads from a client: requests are small (gRPC caps its own
#: at the same 1 MiB), and each connection waiting for one may hold this much.
MAX_REQUEST_FRAME_BYTES: Final = 1 << 20
_LENGTH: Final = struct.Struct(">I")


class FrameError(Exception):
    """The peer broke the framing: a short frame, an oversized one, or stray descriptors."""


def send_frame(sock: socket.socket, payload: bytes, fds: Sequence[int] = ()) -> None:
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES} limit")
    data = _LENGTH.pack(len(payload)) + payload
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def recv_frame(
    sock: socket.socket,
    max_fds: int = 0,
    *,
    max_bytes: int = MAX_FRAME_BYTES,
    deadline: float | None = None,
) -> tuple[bytes, list[int]] | None:
    """One frame and the descriptors that came with it; None on a clean end of stream.

    Received descriptors are close-on-exec. More descriptors than ``max_fds`` (or any
    when ``max_fds`` is 0) is a :class:`FrameError`, and every descriptor that did
    arrive is closed first, so a misbehaving peer cannot leak them into us.

    ``deadline`` (a :func:`time.monotonic` value) bounds the whole frame, not each
    read: a peer sending one byte at a time cannot stretch it (:class:`TimeoutError`).
    """
    fds: list[int] = []
    try:
        _until(sock, deadline)
        head, fds, flags = _recv_with_fds(sock, _LENGTH.size, max(max_fds, 1))
        if not head:
            return None
        if flags & socket.MSG_CTRUNC or len(fds) > max_fds:
            raise FrameError(f"peer sent more than {max_fds} file descriptors")
        header = bytearray(head)
        _read_exact(sock, header, _LENGTH.size, deadline)
        (length,) = _LENGTH.unpack(header)
        if length > max_bytes:
            raise FrameError(f"peer announced a {length}-byte frame (limit {max_bytes})")
        payload = bytearray()
        _read_exact(sock, payload, length, deadline)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return bytes(payload), fds


def _until(sock: socket.socket, deadline: float | None) -> None:
    """Make the next read wait no longer than what is left before ``deadline``."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the frame did not arrive in time")
    sock.settimeout(left)


def _recv_with_fds(sock: socket.socket, size: int, max_fds: int) -> tuple[bytes, list[int], int]:
    """``recvmsg`` with ``MSG_CMSG_CLOEXEC`` (``socket.recv_fds`` drops its flags argument)."""
    item = array.array("i")
    data, ancillary, flags, _ = sock.recvmsg(
        size, socket.CMSG_SPACE(max_fds * item.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            item.frombytes(payload[: len(payload) - len(payload) % item.itemsize])
    return data, list(item), flags


def _read_exact(sock: socket.socket, buf: bytearray, n: int, deadline: float | None) -> None:
    while len(buf) < n:
        _until(sock, deadline)
        more = sock.recv(min(n - len(buf), 1 << 20))
        if not more:
            raise FrameError(f"connection closed inside a frame ({len(buf)} of {n} bytes)")
        buf += more
