"""The side socket's accept loop when a connection's thread cannot be started.

The loop starts each connection's thread itself (not ``threading.Thread``, whose
``start()`` waits for the new thread to run); a host at its thread limit makes that
raise, and the connection must then get a refusal it can read while the loop goes
on taking the next ones. In process, because the failure is injected: a real
thread limit would take the test runner down with the daemon.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weightd.client.base.errors import ResourceExhaustedError
from weightd.client.transports.local import LocalConnection, local_stats
from weightd.server.registry.models import ModelRegistry
from weightd.server.transports import local_server
from weightd.server.transports.local_server import LocalServer
from weightd.server.transports.local_service import PackService
from weightd.server.transports.options import LocalConfig
from weightd.server.weights.service import WeightService


@pytest.fixture
def side() -> Iterator[tuple[LocalServer, str]]:
    # AF_UNIX paths are limited to ~108 bytes, so not pytest's deep tmp_path.
    with tempfile.TemporaryDirectory(prefix="wd-", dir="/tmp") as tmp:
        path = str(Path(tmp) / "s.local")
        server = LocalServer(path, PackService(WeightService(ModelRegistry()), LocalConfig()), 8)
        server.start()
        try:
            yield server, path
        finally:
            server.close()


class _NoThreads:
    """Stands in for ``_thread`` on a host that has no thread left to give."""

    calls = 0

    def start_new_thread(self, *args: Any, **kwargs: Any) -> int:
        self.calls += 1
        raise RuntimeError("can't start new thread")


def test_connections_are_served_on_their_own_threads(side: tuple[LocalServer, str]) -> None:
    server, path = side
    held = LocalConnection(path, "shm")  # a connection that stays open...
    try:
        stats = local_stats(path)  # ...does not keep the next one from being answered
        assert stats.connections == 2
    finally:
        held.close()
    deadline = time.monotonic() + 10.0  # each thread gives its slot back when its peer leaves
    while server.service.connections() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.service.connections() == 0


def test_a_thread_that_cannot_start_is_refused_and_the_loop_goes_on(
    side: tuple[LocalServer, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, path = side
    fake = _NoThreads()
    monkeypatch.setattr(local_server, "_thread", fake)
    for _ in range(3):  # each refused, none of them keeps a slot
        with pytest.raises(ResourceExhaustedError, match="cannot start a thread"):
            LocalConnection(path, "shm")
    assert fake.calls == 3
    assert server.service.connections() == 0
    monkeypatch.undo()
    stats = local_stats(path)  # the accept loop survived and serves the next one
    assert stats.connections == 1
