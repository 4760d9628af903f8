"""Declared layouts with a real daemon: built before SERVING and again at reload, the
shard pages dropped once the packs are the resident copy (mincore), other layouts still
served correctly over gRPC, and a worker's layout nobody declared served at once.

Order is proven with the daemon's own events (its log), never a clock.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.conftest import run_daemon
from tests.models import read_checkpoint
from tests.shm.procs import Worker
from weightd.client import AdminClient, WeightClient
from weightd.client.transports.local import local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.server.store.residency import resident_bytes

pytestmark = pytest.mark.e2e


def _events(log: str, name: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(rf"\b{name}\b", line)]


DROP_CACHES = "/proc/sys/vm/drop_caches"


def _host_memory(url: str) -> dict[str, float]:
    """The model's host-memory series from a scrape (``daemon/memory.py``)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as reply:  # loopback only
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == "demo"
        and sample.name
        in (
            "weightd_shm_pack_resident_bytes",
            "weightd_model_host_bytes",
            "weightd_model_host_copies_ratio",
            "weightd_model_resident_bytes",
        )
    }


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _page_cache(directory: Path) -> tuple[int, int]:
    """(bytes, bytes resident in the page cache) of the checkpoint's shards."""
    total = resident = 0
    for shard in directory.glob("*.safetensors"):
        fd = os.open(shard, os.O_RDONLY)
        try:
            mapped, held = resident_bytes(fd)
        finally:
            os.close(fd)
        total += mapped
        resident += held
    return total, resident


def test_declared_layouts_are_built_before_serving_and_after_reload(
    demo_model: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "model"
    shutil.copytree(demo_model, directory)
    extra = [
        *("--layout", "demo=tp=2", "--admin-listen", f"unix://{tmp_path}/run/admin.sock"),
        *("--metrics-listen", "127.0.0.1:0"),
    ]
    with run_daemon(tmp_path, [("demo", directory)], extra) as daemon:
        log = daemon.log()
        built = _events(log, "pack_built")
        layouts = [re.findall(r"layout=(\S+)", b) for b in built]
        assert layouts == [["tp2:r0"], ["tp2:r1"]]
        # Built as part of loading: before the model was published and the daemon said so.
        assert log.index("layouts_built") < log.index("weightd: serving models=demo")
        assert "declared=true" in built[0] and "shard_pages_dropped=true" in log
        path = side_socket_path(daemon.target)
        assert path is not None
        stats = local_stats(path)
        assert sorted((p.layout.tp_size, p.layout.tp_rank, p.declared) for p in stats.packs) == [
            (2, 0, True),
            (2, 1, True),
        ]
        # Held by the daemon (never aged out by the TTL), not by a worker: no lease counted.
        assert all(p.leases == 0 and not p.building for p in stats.packs)

        # One copy: the packs are resident, the shard pages were dropped (mincore).
        payload, cached = _page_cache(directory)
        assert cached < 0.05 * payload, (cached, payload)
        # ... and the daemon says so: page cache plus packs is about one payload.
        held = _host_memory(daemon.address("metrics"))
        assert 0.99 * payload <= held["weightd_shm_pack_resident_bytes"] <= 1.05 * payload
        assert 0.99 <= held["weightd_model_host_copies_ratio"] <= 1.1, held
        if os.access(DROP_CACHES, os.W_OK):  # root: the packs survive drop_caches
            with open(DROP_CACHES, "w") as f:
                f.write("3\n")
            after = _host_memory(daemon.address("metrics"))
            assert (
                after["weightd_shm_pack_resident_bytes"] == held["weightd_shm_pack_resident_bytes"]
            )

        # The first worker of the declared layout maps the prebuilt pack.
        with Worker() as w:
            reply = w.ok("fetch", target=daemon.target, rank=1, world_size=2, transport="shm")
            assert reply["transport"] == "shm" and not reply["pack"]["built"]

        # Another layout over gRPC: read from the shards again, verified, bit for bit;
        # the pages that stream brought back are dropped again when it ends.
        want = {n: _digest(t) for n, t in read_checkpoint(directory).items()}
        gc.collect()  # safetensors mapped the files: mapped pages cannot be dropped
        with WeightClient(daemon.target, timeout=60) as c:
            got = c.fetch(0, 1, transport="grpc")
        assert {n: _digest(t) for n, t in got.items()} == want
        del got
        _, cached = _page_cache(directory)
        assert cached < 0.05 * payload, (cached, payload)

        # A reload builds (here: finds, same content) and holds them again, and drops
        # the pages its verification read.
        with AdminClient(daemon.address("admin"), timeout=120) as admin:
            admin.reload("demo")
        log = daemon.log()
        assert len(_events(log, "layouts_built")) == 2
        after = local_stats(path)
        assert sorted((p.layout.tp_size, p.layout.tp_rank) for p in after.packs) == [(2, 0), (2, 1)]
        assert {p.pack_id for p in after.packs} == {p.pack_id for p in stats.packs}
        _, cached = _page_cache(directory)
        assert cached < 0.05 * payload, (cached, payload)


def test_an_undeclared_layout_is_served_over_grpc_while_its_pack_builds(
    demo_model: Path, tmp_path: Path
) -> None:
    """The first worker is told the pack is building and fetches from the verified shards
    (gRPC) without waiting; the daemon logged ``pack_pending`` before that build's
    ``pack_built``; the next worker maps the pack, and the layout is remembered."""
    with run_daemon(tmp_path, [("demo", demo_model)]) as daemon, Worker() as w:
        first = w.ok("fetch", target=daemon.target, rank=0, world_size=4)
        assert first["transport"] == "grpc"
        grpc_digests = w.ok("digests")["digests"]
        w.ok("drop")
        log = daemon.log()
        pending = _events(log, "pack_pending")
        assert pending and "layout=tp4:r0" in pending[0] and "build=started" in pending[0]
        # Wait for the build, as the daemon's own table tells it.
        path = side_socket_path(daemon.target)
        assert path is not None
        deadline = time.monotonic() + 120
        while not any(not p.building for p in local_stats(path).packs):
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.05)
        log = daemon.log()
        assert log.index("pack_pending") < log.index("pack_built")
        second = w.ok("fetch", target=daemon.target, rank=0, world_size=4)
        assert second["transport"] == "shm" and not second["pack"]["built"]
        assert w.ok("digests")["digests"] == grpc_digests
    memory = list((tmp_path / "cache" / "layouts").glob("*.json"))
    assert len(memory) == 1 and '"tp": 4' in memory[0].read_text()
