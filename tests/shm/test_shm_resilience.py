"""What a worker holding a pack survives: a daemon restart, a truncated or rewritten shard."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_daemon
from tests.shm.procs import Worker
from tests.shm.worker import digest
from weightd.client import DataLossError, WeightClient

pytestmark = pytest.mark.e2e


def test_restart_leaves_held_tensors_valid_and_new_fetches_work(
    demo_model: Path, tmp_path: Path
) -> None:
    models = [("demo", demo_model)]
    with Worker() as worker:
        with run_daemon(tmp_path, models) as first:
            reply = worker.ok("fetch", target=first.target, rank=1, world_size=2, transport="shm")
            old_ref = reply["pack"]
            held = worker.ok("digests")["digests"]
            with WeightClient(first.target, timeout=60) as c:
                want = c.fetch(1, 2, transport="grpc")
            assert held == {n: digest(t) for n, t in want.items()}
        # The first daemon has exited; the worker's mapping keeps the pages alive.
        assert worker.ok("touch")["digests"] == held
        with run_daemon(tmp_path, models) as second:  # same socket, new boot
            assert worker.ok("digests")["digests"] == held
            stale = worker.call("attach", target=second.target, ref=old_ref)
            assert not stale["ok"] and stale["code"] == "FAILED_PRECONDITION"
            assert old_ref["boot_id"] in stale["error"] and "restarted" in stale["error"]
            fresh = worker.ok("fetch", target=second.target, rank=1, world_size=2, transport="shm")
            assert fresh["transport"] == "shm"
            assert fresh["pack"]["boot_id"] != old_ref["boot_id"]
            # The first daemon remembered the layout (its cache directory is the same):
            # the second built it at start, before SERVING, not for this request.
            assert not fresh["pack"]["built"]
            assert "pack_built model=demo layout=tp2:r1" in second.log_path.read_text()
            assert worker.ok("digests")["digests"] == held


def test_damaged_shards_cannot_disturb_mapped_weights(demo_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    shards = sorted(model.glob("*.safetensors"))
    assert len(shards) >= 2
    with Worker() as worker, run_daemon(tmp_path, [("demo", model)]) as daemon:
        # World size 1: the pack holds every tensor of every shard.
        reply = worker.ok("fetch", target=daemon.target, rank=0, world_size=1, transport="shm")
        assert reply["transport"] == "shm"
        held = worker.ok("digests")["digests"]

        os.truncate(shards[0], shards[0].stat().st_size // 2)  # would SIGBUS a file mapping
        with open(shards[1], "r+b") as f:  # rewritten in place: same inode, new bytes
            f.seek(4096)
            f.write(b"\xff" * (shards[1].stat().st_size - 4096))

        assert worker.ok("touch")["digests"] == held  # alive, and unchanged
        # The pack was verified and sealed before the damage: it is still served as is ...
        again = worker.ok("fetch", target=daemon.target, rank=0, world_size=1, transport="shm")
        assert again["pack"]["pack_id"] == reply["pack"]["pack_id"]
        assert worker.ok("digests")["digests"] == held
        # ... while reading the damaged files is refused, and the model stops serving.
        with WeightClient(daemon.target, timeout=60) as c:
            with pytest.raises(DataLossError):
                c.fetch(0, 1, transport="grpc")
            with pytest.raises(DataLossError, match="not served until reloaded"):
                c.fetch(0, 1, transport="shm")
        assert worker.ok("digests")["digests"] == held
