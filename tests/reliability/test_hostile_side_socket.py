"""The side socket bounds each exchange as a whole, not each read (#15 item 9).

Out of process against a real daemon, with its side-socket limits turned down so the
attacks are short: a client dripping its request one byte at a time, one announcing a
frame far over the request limit, one packing a megabyte of tiny names, and clients
holding every slot. Before, a drip held a connection as long as each byte came within
30 s of the last, frames of 64 MiB were read whole, and a client past the slots read the
refusal as its hello and then reported ``UNAVAILABLE "Broken pipe"``.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.reliability.load_support import demo_model
from weightd.client import ResourceExhaustedError, WeightClient
from weightd.client.transports.local import LocalConnection
from weightd.client.transports.selection import side_socket_path
from weightd.common.frames import recv_frame, send_frame
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

pytestmark = pytest.mark.e2e
__all__ = ["demo_model"]

REQUEST_SECONDS = 2.0
MAX_CONNECTIONS = 3


@pytest.fixture(scope="module")
def daemon(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("hostile-side")
    extra = [
        "--side-request-seconds",
        str(REQUEST_SECONDS),
        "--side-max-connections",
        str(MAX_CONNECTIONS),
    ]
    with run_daemon(tmp, [("demo", demo_model)], extra) as d:
        yield d


def _connect(daemon: RunningDaemon) -> socket.socket:
    path = side_socket_path(daemon.target)
    assert path is not None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    hello = recv_frame(sock)
    assert hello is not None and lpb.LocalHello.FromString(hello[0]).boot_id
    return sock


def _closed_by_daemon(sock: socket.socket, drip: bytes, seconds: float) -> bool:
    """Send ``drip`` a byte every 0.25 s for up to ``seconds``; True once the daemon hangs up."""
    deadline = time.monotonic() + seconds
    for byte in drip:
        if time.monotonic() > deadline:
            return False
        try:
            sock.send(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return True
        time.sleep(0.25)
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_request_dripped_byte_by_byte_is_cut_at_the_request_deadline(
    daemon: RunningDaemon,
) -> None:
    sock = _connect(daemon)
    try:
        # Each byte comes well within the deadline of the one before; the whole would
        # take 50 s. The exchange's deadline (2 s) ends it, not a per-read timeout.
        started = time.monotonic()
        payload = b"\x00" * 200
        closed = _closed_by_daemon(sock, struct.pack(">I", len(payload)) + payload, 20 * 5)
        took = time.monotonic() - started
    finally:
        sock.close()
    assert closed
    assert took < 40  # far below the 50 s the drip would last, generous for a busy host


def test_a_frame_over_the_request_limit_is_refused_before_it_is_read(
    daemon: RunningDaemon,
) -> None:
    sock = _connect(daemon)
    try:
        sock.sendall(struct.pack(">I", (64 << 20) - 1))  # under the old 64 MiB cap
        sock.settimeout(30)
        assert sock.recv(1) == b""  # hung up without an answer: a framing error
    finally:
        sock.close()
    assert "peer announced a 67108863-byte frame (limit 1048576)" in daemon.log()


def test_a_megabyte_of_tiny_names_is_refused_by_the_name_bound(daemon: RunningDaemon) -> None:
    path = side_socket_path(daemon.target)
    assert path is not None
    names = [f"{i:x}" for i in range(120_000)]  # under 1 MiB framed, far over 65,536
    acquire = lpb.AcquirePack(layout=pb.Layout(tp_size=1), names=names)
    conn = LocalConnection(path, "shm", timeout=30)
    try:
        with pytest.raises(ResourceExhaustedError) as err:
            conn.request(lpb.LocalRequest(acquire=acquire), max_fds=1)
    finally:
        conn.close()
    assert "field acquire.names has 120000 elements; the limit is 65536" in err.value.detail


def test_past_the_last_slot_the_client_reports_the_daemons_reason(
    daemon: RunningDaemon,
) -> None:
    held = [_connect(daemon) for _ in range(MAX_CONNECTIONS)]
    try:
        path = side_socket_path(daemon.target)
        assert path is not None
        with pytest.raises(ResourceExhaustedError) as err:
            LocalConnection(path, "shm", timeout=30)
        assert f"the daemon holds {MAX_CONNECTIONS} side-channel connections already" in str(
            err.value
        )
        assert err.value.transport == "shm"  # the transport's failure: auto falls back
        with WeightClient(daemon.target, timeout=60) as client:
            state, info = client.fetch_with_info(0, 2)  # auto: shm refused, gRPC serves
        assert state and info.transport == "grpc"
        assert [f.transport for f in info.fallbacks] == ["shm"]
        assert isinstance(info.fallbacks[0].error, ResourceExhaustedError)
        assert "side-channel connections already" in info.fallbacks[0].error.detail
    finally:
        for sock in held:
            sock.close()
    # The held slots free when their (idle) clients hit the request deadline or leave.
    with WeightClient(daemon.target, timeout=60) as client:
        for _ in range(100):
            try:
                assert client.fetch(0, 2, transport="shm")
                break
            except ResourceExhaustedError:
                time.sleep(0.1)
        else:
            pytest.fail("the side socket never freed its slots")


def test_a_well_behaved_raw_exchange_still_gets_its_answer(daemon: RunningDaemon) -> None:
    """A well-behaved exchange over a raw socket still gets its answer."""
    sock = _connect(daemon)
    try:
        send_frame(sock, lpb.LocalRequest(stats=lpb.PackStatsRequest()).SerializeToString())
        got = recv_frame(sock)
    finally:
        sock.close()
    assert got is not None and lpb.LocalResponse.FromString(got[0]).HasField("stats")
