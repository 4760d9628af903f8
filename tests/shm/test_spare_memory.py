"""Spare pack memory with a real daemon (``--spare-pack-bytes``): prepared after a build,
filled by the next publish's build, and never more than the budget.

Order is proven with the daemon's own events (its log), never a clock.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import run_daemon
from tests.shm.procs import Worker
from weightd.client import AdminClient
from weightd.server.cli.demo import DEMO_CONFIG, write_llama_checkpoint

pytestmark = pytest.mark.e2e

BUDGET = 256 << 20


def _built(log: str) -> list[str]:
    return re.findall(r"layouts_built .*", log)


def _wait_for(daemon_log: Callable[[], str], pattern: str, count: int) -> str:
    deadline = time.monotonic() + 120
    while True:
        log = daemon_log()
        if len(re.findall(pattern, log)) >= count or time.monotonic() > deadline:
            return log
        time.sleep(0.1)


def test_a_publish_fills_the_spare_memory_prepared_after_the_previous_build(
    tmp_path: Path,
) -> None:
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    write_llama_checkpoint(str(v1), DEMO_CONFIG, seed=1)
    write_llama_checkpoint(str(v2), DEMO_CONFIG, seed=2)  # same shapes, other bytes
    extra = [
        *("--layout", "m=tp=2", "--spare-pack-bytes", str(BUDGET)),
        *("--admin-listen", f"unix://{tmp_path}/run/admin.sock"),
    ]
    with run_daemon(tmp_path, [("m", v1)], extra) as daemon:
        # At start there was nothing to fill: fresh memory, then spares prepared for
        # the next version's packs (both ranks), off the build's path.
        start = _built(daemon.log())
        assert len(start) == 1 and "spare_packs=0" in start[0], start
        log = _wait_for(daemon.log, r"spare pack memory: \d+ prepared", 1)
        prepared = re.findall(r"spare pack memory: (\d+) prepared, (\d+) bytes held of (\d+)", log)
        assert prepared and sum(int(n) for n, _, _ in prepared) == 2, prepared
        assert all(int(held) <= BUDGET == int(of) for _, held, of in prepared)

        with AdminClient(daemon.address("admin"), timeout=120) as admin:
            assert admin.publish(str(v2), model="m").version == 2
        published = _built(daemon.log())
        assert len(published) == 2 and "spare_packs=2" in published[1], published

        # What was built into spare memory is the new version, bit for bit: the same
        # digests as the same rank streamed over gRPC from v2's verified shards.
        with Worker() as w:
            for rank in (0, 1):
                reply = w.ok(
                    "fetch", target=daemon.target, rank=rank, world_size=2, transport="shm"
                )
                assert reply["transport"] == "shm" and not reply["pack"]["built"]
                mapped = w.ok("digests")["digests"]
                w.ok("fetch", target=daemon.target, rank=rank, world_size=2, transport="grpc")
                assert w.ok("digests")["digests"] == mapped
