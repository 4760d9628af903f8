"""Side-channel framing over a real socket pair, descriptors included."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from weightd.common.frames import (
    MAX_FRAME_BYTES,
    MAX_REQUEST_FRAME_BYTES,
    FrameError,
    recv_frame,
    send_frame,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_round_trip_with_a_descriptor(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        send_frame(a, b"hello", [r])
        # Bigger than the socket buffer: sent from a thread while we read.
        sender = threading.Thread(target=send_frame, args=(a, b"x" * 300_000))
        sender.start()
        payload, fds = recv_frame(b, max_fds=1) or (b"", [])
        assert payload == b"hello" and len(fds) == 1
        os.write(w, b"!")
        assert os.read(fds[0], 1) == b"!"  # the very same pipe
        assert os.get_inheritable(fds[0]) is False  # received close-on-exec
        os.close(fds[0])
        second = recv_frame(b, max_fds=1)
        assert second is not None and second[0] == b"x" * 300_000 and second[1] == []
        sender.join(5)
    finally:
        os.close(r)
        os.close(w)


def test_clean_end_of_stream_is_none(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.close()
    assert recv_frame(b) is None


def test_unexpected_descriptors_are_closed_not_leaked(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    r, w = os.pipe()
    before = _open_fds()
    try:
        send_frame(a, b"sneaky", [r, w])
        with pytest.raises(FrameError, match="more than 1 file descriptors"):
            recv_frame(b, max_fds=1)
        assert _open_fds() == before
    finally:
        os.close(r)
        os.close(w)


def test_oversized_and_truncated_frames(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with pytest.raises(FrameError, match="exceeds"):
        send_frame(a, b"\0" * (MAX_FRAME_BYTES + 1))
    a.sendall(struct.pack(">I", MAX_FRAME_BYTES + 1))
    with pytest.raises(FrameError, match="announced"):
        recv_frame(b)
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    c.sendall(struct.pack(">I", 10) + b"abc")
    c.close()
    with pytest.raises(FrameError, match="3 of 10 bytes"):
        recv_frame(d)
    d.close()


def test_a_deadline_bounds_the_whole_frame_not_each_read(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    stop = threading.Event()

    def drip() -> None:  # a byte every 20 ms: each read is quick, the frame never ends
        data = struct.pack(">I", 1000) + b"x" * 1000
        for byte in data:
            if stop.wait(0.02):
                return
            a.send(bytes([byte]))

    t = threading.Thread(target=drip)
    t.start()
    try:
        with pytest.raises(TimeoutError):
            recv_frame(b, deadline=time.monotonic() + 0.3)
    finally:
        stop.set()
        t.join(5)


def test_max_bytes_refuses_a_frame_before_reading_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(struct.pack(">I", MAX_REQUEST_FRAME_BYTES + 1))
    with pytest.raises(FrameError, match=f"limit {MAX_REQUEST_FRAME_BYTES}"):
        recv_frame(b, max_bytes=MAX_REQUEST_FRAME_BYTES)
