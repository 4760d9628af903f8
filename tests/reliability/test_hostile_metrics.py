"""The metrics port holds a bounded number of threads and connections (#15 item 10).

Out of process against a real daemon on loopback: a few hundred idle connections, and
one dripping its request a byte at a time. Before, prometheus_client's server spent a
thread and a descriptor per idle connection, with no timeout (1,500 connections held
1,500 threads), for as long as the client liked.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.reliability.load_support import demo_model

pytestmark = pytest.mark.e2e
__all__ = ["demo_model"]

IDLE = 300


@pytest.fixture(scope="module")
def daemon(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("hostile-metrics")
    with run_daemon(tmp, [("demo", demo_model)], ["--metrics-listen", "127.0.0.1:0"]) as d:
        yield d


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads: line")


def _fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _scrape(daemon: RunningDaemon) -> str:
    with urllib.request.urlopen(daemon.address("metrics"), timeout=30) as reply:
        assert reply.status == 200
        return reply.read().decode()


def test_idle_connections_cost_no_threads_and_scrapes_still_answer(
    daemon: RunningDaemon,
) -> None:
    url = urlparse(daemon.address("metrics"))
    assert "weightd_build_info" in _scrape(daemon)
    pid = daemon.process.pid
    threads, fds = _threads(pid), _fds(pid)
    idle = []
    try:
        for _ in range(IDLE):
            idle.append(socket.create_connection((url.hostname, url.port), timeout=30))
        time.sleep(0.5)  # let the daemon accept what it will
        during_threads, during_fds = _threads(pid), _fds(pid)
        # A scrape still gets through: it takes the slot of the longest-idle connection.
        assert "weightd_build_info" in _scrape(daemon)
    finally:
        for s in idle:
            s.close()
    print(f"\n{IDLE} idle: threads {threads} -> {during_threads}, fds {fds} -> {during_fds}")
    assert during_threads <= threads + 4  # at most the scrape pool's own threads
    assert during_fds <= fds + 64  # the connection cap (32), not one per client


def test_a_client_dripping_its_request_is_dropped(daemon: RunningDaemon) -> None:
    url = urlparse(daemon.address("metrics"))
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 200
        dropped = False
        for byte in request:  # one byte every 0.2 s: ~45 s in all, past the 10 s deadline
            try:
                s.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                dropped = True
                break
            time.sleep(0.2)
        if not dropped:
            try:
                dropped = s.recv(1) == b""
            except ConnectionResetError:
                dropped = True
    assert dropped


def test_only_get_of_the_metrics_path_is_served(daemon: RunningDaemon) -> None:
    url = urlparse(daemon.address("metrics"))
    for request, status in [
        (b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
        (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
        (b"nonsense\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"a" * 9000 + b"\r\n\r\n", b"431"),
    ]:
        with socket.create_connection((url.hostname, url.port), timeout=30) as s:
            s.sendall(request)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply.split(b" ", 2)[1] == status, reply[:200]
