"""Leases, TTL and the byte budget, observed through the daemon's pack table.

Two daemons serve the demo model (one rank pack at world size 2 is ~5.2 MB): one with
a budget that holds one such pack and not two (and a long TTL, so only the budget
frees packs), one with a one-second TTL.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.shm.procs import Worker
from weightd.client import ResourceExhaustedError, WeightClient
from weightd.client.transports.local import local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.v1 import local_pb2 as lpb

pytestmark = pytest.mark.e2e

TTL = 1.0
BUDGET = 6_000_000


@pytest.fixture(scope="module")
def daemon(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """Budget for one pack; packs are freed only to make room (TTL of an hour)."""
    extra = ["--shm-budget-bytes", str(BUDGET), "--pack-ttl", "3600"]
    with run_daemon(tmp_path_factory.mktemp("budget"), [("demo", demo_model)], extra) as d:
        yield d


@pytest.fixture(scope="module")
def ttl_daemon(
    demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    extra = ["--pack-ttl", str(TTL)]
    with run_daemon(tmp_path_factory.mktemp("ttl"), [("demo", demo_model)], extra) as d:
        yield d


@pytest.fixture
def client(daemon: RunningDaemon) -> Iterator[WeightClient]:
    wait_until(daemon, lambda s: all(p.leases == 0 for p in s.packs), "earlier leases to end")
    with WeightClient(daemon.target, timeout=60) as c:
        yield c


def stats(daemon: RunningDaemon) -> lpb.LocalStats:
    path = side_socket_path(daemon.target)
    assert path is not None
    return local_stats(path)


def packs(daemon: RunningDaemon) -> dict[int, int]:
    """tp_rank → leases, for every pack the daemon holds."""
    return {p.layout.tp_rank: p.leases for p in stats(daemon).packs}


def wait_until(
    daemon: RunningDaemon, ok: Callable[[lpb.LocalStats], bool], what: str, timeout: float = 15
) -> lpb.LocalStats:
    deadline = time.monotonic() + timeout
    while True:
        # Tensors kept alive only by reference cycles (a finished test's frame and the
        # traceback pytest.raises holds) release their lease when the collector runs.
        gc.collect()
        s = stats(daemon)
        if ok(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {s}")
        time.sleep(0.05)


def test_budget_refuses_while_leased_then_evicts_lru(
    daemon: RunningDaemon, client: WeightClient, caplog: pytest.LogCaptureFixture
) -> None:
    held = client.fetch(0, 2, transport="shm")
    assert packs(daemon) == {0: 1}
    with pytest.raises(ResourceExhaustedError) as err:
        client.fetch(1, 2, transport="shm")
    assert err.value.transport == "shm"
    assert "budget exhausted" in err.value.detail and str(BUDGET) in err.value.detail
    assert packs(daemon) == {0: 1}  # the leased pack was not touched

    # auto: the failure is reported (WARNING and in the info), and gRPC serves instead.
    with caplog.at_level(logging.WARNING, logger="weightd.client"):
        state, info = client.fetch_with_info(1, 2)
    assert info.transport == "grpc" and state
    assert [f.transport for f in info.fallbacks] == ["shm"]
    assert isinstance(info.fallbacks[0].error, ResourceExhaustedError)
    assert any("shm transport failed" in r.getMessage() for r in caplog.records)

    del held
    gc.collect()  # the last tensor goes: the mapping's finalizer closes the lease
    wait_until(daemon, lambda s: [p.leases for p in s.packs] == [0], "rank 0 to be released")
    before = stats(daemon).evictions_total
    again = client.fetch(1, 2, transport="shm")  # fits once the idle rank-0 pack is freed
    assert again
    assert packs(daemon) == {1: 1}
    assert stats(daemon).evictions_total == before + 1


def test_ttl_frees_idle_packs_but_never_a_leased_one(ttl_daemon: RunningDaemon) -> None:
    with WeightClient(ttl_daemon.target, timeout=60) as client:
        held = client.fetch(0, 2, transport="shm")
        time.sleep(3 * TTL)  # three TTLs with the lease held
        assert packs(ttl_daemon) == {0: 1}
        del held
        gc.collect()
        wait_until(ttl_daemon, lambda s: not s.packs, "the TTL to free the released pack")
        assert stats(ttl_daemon).host_bytes == 0 and stats(ttl_daemon).evictions_total == 1


def test_copy_does_not_hold_the_lease(daemon: RunningDaemon, client: WeightClient) -> None:
    private = client.fetch(0, 2, transport="shm", copy=True)
    # The client closed the lease before returning; the daemon sees the close shortly
    # after. The private tensors stay alive throughout: they do not hold the lease.
    wait_until(daemon, lambda s: [p.leases for p in s.packs] == [0], "the daemon to see it")
    assert private and packs(daemon) == {0: 0}  # kept for the next asker (TTL)


def test_lease_ends_when_its_holder_is_killed(daemon: RunningDaemon, client: WeightClient) -> None:
    with Worker() as worker:
        reply = worker.ok("fetch", target=daemon.target, rank=0, world_size=2, transport="shm")
        assert reply["transport"] == "shm"
        assert packs(daemon) == {0: 1}
        worker.kill()  # SIGKILL: no finalizer runs; the kernel closes the connection
        wait_until(daemon, lambda s: [p.leases for p in s.packs] == [0], "the dead lease to end")
