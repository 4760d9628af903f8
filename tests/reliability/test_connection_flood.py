"""Connections one client can make the daemon keep: bounded in all, idle ones closed.

A real daemon out of process; a client opening real gRPC connections (each its own
subchannel, handshake done) in a loop, as hard as it can. The daemon's descriptors
stay within its connection bound (they would grow by one per connection, to the
open-file limit, where the daemon can open no shard or pack), and once the flood's
connections sit idle they are closed, so an engine connecting afterwards is served.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.reliability.load_support import demo_model
from weightd.client import WeightClient

pytestmark = pytest.mark.e2e
__all__ = ["demo_model"]

MAX_CONNECTIONS = 24
IDLE_SECONDS = 2.0
FLOOD = 60


@pytest.fixture
def daemon(demo_model: Path, tmp_path: Path) -> Iterator[RunningDaemon]:
    extra = ["--max-connections", str(MAX_CONNECTIONS)]
    extra += ["--connection-idle-seconds", str(IDLE_SECONDS)]
    with run_daemon(tmp_path, [("demo", demo_model)], extra) as d:
        yield d


def _sockets(pid: int) -> int:
    out = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return out


def test_a_connection_flood_keeps_the_daemon_within_its_bound(daemon: RunningDaemon) -> None:
    pid = daemon.process.pid
    before = _sockets(pid)
    channels = []
    try:
        for _ in range(FLOOD):
            channel = grpc.insecure_channel(
                daemon.target, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            channels.append(channel)
            with contextlib.suppress(grpc.FutureTimeoutError):
                grpc.channel_ready_future(channel).result(timeout=1)
        assert _sockets(pid) - before <= MAX_CONNECTIONS + 4
        deadline = time.monotonic() + 30
        while _sockets(pid) - before > 4:  # the idle ones are closed
            assert time.monotonic() < deadline, _sockets(pid) - before
            time.sleep(0.2)
        with WeightClient(daemon.target, timeout=30) as engine:
            assert [m.name for m in engine.list_models()] == ["demo"]
    finally:
        for channel in channels:
            channel.close()
