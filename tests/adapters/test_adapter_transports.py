"""Adapters over shared memory, their leases, their metrics: one real daemon process.

The daemon serves the tiny Llama with an adapter root, a metrics listener and an
adapter budget; each test leaves no adapter loaded behind it, and checks counters as
differences, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.adapters.conftest import Fixture, expected, race, same_bytes
from tests.conftest import RunningDaemon, run_daemon
from tests.gpu.test_cuda_ipc import wait_until
from tests.ops.conftest import scrape
from tests.ops.test_ops_e2e import _tool
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient
from weightd.client.base.errors import (
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
)
from weightd.client.transports.local import local_stats
from weightd.client.transports.selection import side_socket_path

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def budget(lora: Fixture) -> int:
    """Room for exactly 8 copies of the "second" adapter (r=8): weights and config."""
    return 8 * _held_bytes(lora.second_dir) + 1024


def _held_bytes(adapter_dir: Path) -> int:
    """What one loaded version counts against the budget: its weights file and its config
    (the parsed form is kept)."""
    return sum(
        (adapter_dir / name).stat().st_size
        for name in ("adapter_model.safetensors", "adapter_config.json")
    )


@pytest.fixture(scope="module")
def daemon(
    lora: Fixture, budget: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("adapter-transports")
    extra = ["--adapter-root", str(lora.root), "--adapter-budget-bytes", str(budget)]
    extra += ["--metrics-listen", "127.0.0.1:0", "--pack-ttl", "600"]
    with run_daemon(tmp, [("tiny-llama", lora.base_dir)], extra) as d:
        yield d


@pytest.fixture(scope="module")
def admin(daemon: RunningDaemon) -> Iterator[AdminClient]:
    sock = Path(daemon.target.removeprefix("unix://")).parent / "admin.sock"
    with AdminClient(f"unix://{sock}", timeout=60) as a:
        yield a


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(daemon.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def config(lora: Fixture) -> dict[str, object]:
    return dict(json.loads((lora.base_dir / "config.json").read_text()))


def adapter_packs(daemon: RunningDaemon) -> dict[tuple[str, int, int], int]:
    """(adapter, version, rank) -> leases of every TP=2 adapter pack (what these tests'
    workers lease), from the side socket's stats. The TP=1 pack each load builds for
    vLLM's shared hand-over is left out (``test_adapter_prebuild.py`` follows it)."""
    path = side_socket_path(daemon.target)
    assert path is not None
    return {
        (p.adapter, p.adapter_version, p.layout.tp_rank): p.leases
        for p in local_stats(path).packs
        if p.adapter and p.layout.tp_size == 2
    }


def metrics(daemon: RunningDaemon) -> dict[str, float]:
    """Every sample of a real scrape, keyed by name (and labels, if any)."""
    out = {}
    for family in text_string_to_metric_families(scrape(daemon.address("metrics"))):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_shm_adapter_equals_grpc_for_every_rank(
    lora: Fixture, daemon: RunningDaemon, admin: AdminClient, client: WeightClient
) -> None:
    v = admin.load_adapter("eq", str(lora.adapter_dir))
    try:
        for rank in range(2):
            grpc = client.fetch_adapter("eq", rank, 2, transport="grpc")
            shm = client.fetch_adapter("eq", rank, 2, transport="shm")
            auto = client.fetch_adapter("eq", rank, 2)
            assert (grpc.transport, shm.transport, auto.transport) == ("grpc", "shm", "shm")
            assert auto.info is not None and auto.info.reason == "a daemon on this host"
            for got in (shm, auto):
                assert (got.name, got.version, got.digest) == ("eq", v.version, v.digest)
                assert got.base_model == grpc.base_model == "tiny-llama"
                assert got.scaling == grpc.scaling
                assert same_bytes(got.tensors, grpc.tensors)
            assert shm.info is not None and shm.info.pack is not None
            assert shm.info.pack.adapter is not None
            assert shm.info.pack.adapter.version == v.version
            # one pack per (adapter, version, rank), shared: the second fetch built nothing
            assert auto.info.pack is not None and not auto.info.pack.built
            copied = client.fetch_adapter("eq", rank, 2, transport="shm", copy=True)
            assert copied.info is not None and copied.info.copied
            assert same_bytes(copied.tensors, grpc.tensors)
            del grpc, shm, auto, copied, got  # end the leases: nothing views the packs
        assert set(adapter_packs(daemon)) == {("eq", v.version, 0), ("eq", v.version, 1)}
    finally:
        admin.unload_adapter("eq")
    gc.collect()
    wait_until(lambda: not adapter_packs(daemon), "the unloaded adapter's packs to be freed")


def test_replace_while_a_worker_maps_the_pack(
    lora: Fixture,
    daemon: RunningDaemon,
    admin: AdminClient,
    client: WeightClient,
    config: dict[str, object],
) -> None:
    v1 = admin.load_adapter("hot", str(lora.adapter_dir))
    held = client.fetch_adapter("hot", 1, 2, transport="shm")
    assert held.version == v1.version
    want1 = expected(lora.adapter_dir, 2, 1, config)
    assert same_bytes(held.tensors, want1)

    v2 = admin.load_adapter("hot", str(lora.second_dir))  # replace while mapped
    assert v2.version > v1.version
    assert same_bytes(held.tensors, want1)  # the worker's tensors are untouched
    assert adapter_packs(daemon) == {("hot", v1.version, 1): 1}
    before = metrics(daemon)
    assert before["weightd_adapter_versions"] == 2  # v1 stays: the pack's lease holds it
    assert before["weightd_adapter_leases"] == 1

    fresh = client.fetch_adapter("hot", 1, 2, transport="shm")
    assert (fresh.version, fresh.digest) == (v2.version, v2.digest)
    assert same_bytes(fresh.tensors, expected(lora.second_dir, 2, 1, config))
    assert adapter_packs(daemon) == {("hot", v1.version, 1): 1, ("hot", v2.version, 1): 1}

    # The worker lets go of v1: the version and its pack go at once (no TTL wait).
    del held
    wait_until(
        lambda: adapter_packs(daemon) == {("hot", v2.version, 1): 1}, "v1's pack to be freed"
    )
    assert metrics(daemon)["weightd_adapter_versions"] == 1

    # A worker process killed while it maps v2 through an unload: its lease ends with it.
    script = (
        "import sys, time\n"
        "from weightd.client import WeightClient\n"
        "w = WeightClient(sys.argv[1]).fetch_adapter('hot', 0, 2, transport='shm')\n"
        "print(w.version, w.transport, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, daemon.target], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == [str(v2.version), "shm"]
        del fresh
        admin.unload_adapter("hot")
        with pytest.raises(NotFoundError):
            client.fetch_adapter("hot", 0, 2, transport="shm")
        # v2 is unloaded, but the worker process still maps its rank-0 pack: v2 and its
        # packs stay (the rank-1 pack idle, released by this process, freed with v2).
        wait_until(
            lambda: adapter_packs(daemon) == {("hot", v2.version, 0): 1, ("hot", v2.version, 1): 0},
            "only the worker process's lease to remain",
        )
        wait_until(lambda: metrics(daemon)["weightd_adapter_leases"] == 1, "one lease left")
    finally:
        proc.kill()
        proc.wait(30)
    wait_until(lambda: not adapter_packs(daemon), "the killed worker's pack to be freed")
    m = metrics(daemon)
    assert (m["weightd_adapter_versions"], m["weightd_adapter_leases"]) == (0, 0)
    assert (m["weightd_adapter_packs"], m["weightd_adapter_pack_bytes"]) == (0, 0)
    assert admin.list_adapters() == []


def test_metrics_follow_load_replace_unload_evict_reject(
    lora: Fixture, daemon: RunningDaemon, admin: AdminClient, client: WeightClient
) -> None:
    before = metrics(daemon)

    def delta(name: str) -> float:
        return metrics(daemon).get(name, 0.0) - before.get(name, 0.0)

    second_bytes = _held_bytes(lora.second_dir)
    admin.load_adapter("m", str(lora.adapter_dir))
    admin.load_adapter("m", str(lora.second_dir))  # replace
    with pytest.raises(Exception, match="outside the adapter roots"):
        admin.load_adapter("m", str(lora.base_dir))
    with pytest.raises(Exception, match="adapter digest"):
        admin.load_adapter("m", str(lora.adapter_dir), expected_digest="sha256:" + "0" * 64)
    m = metrics(daemon)
    assert (delta("weightd_adapter_loads_total"), delta("weightd_adapter_replaces_total")) == (1, 1)
    assert delta("weightd_adapter_rejections_total{reason=unsafe_path}") == 1
    assert delta("weightd_adapter_rejections_total{reason=digest_mismatch}") == 1
    assert delta("weightd_adapter_load_duration_seconds_count") == 2  # rejections not timed
    assert m["weightd_adapters_loaded"] == 1 and m["weightd_adapter_bytes"] == second_bytes

    pack = client.fetch_adapter("m", 0, 2, transport="shm")
    m = metrics(daemon)
    # The TP=1 pack built at load (idle) and the TP=2 rank's, leased.
    assert (m["weightd_adapter_packs"], m["weightd_adapter_pack_leases"]) == (2, 1)
    assert m["weightd_adapter_pack_bytes"] >= sum(
        t.numel() * t.element_size() for t in pack.tensors.values()
    )
    del pack

    # Fill the budget with 8 copies of "second" ("m" is one): the 9th evicts the LRU.
    admin.pin_adapter("m")
    for i in range(7):
        admin.load_adapter(f"e{i}", str(lora.second_dir))
    assert metrics(daemon)["weightd_adapters_loaded"] == 8
    admin.load_adapter("e7", str(lora.second_dir))
    names = [s.name for s in admin.list_adapters()]
    assert "e0" not in names and "m" in names  # LRU evicted; the pinned one stays
    assert delta("weightd_adapter_evictions_total") == 1
    m = metrics(daemon)
    assert m["weightd_adapters_loaded"] == 8 and m["weightd_adapters_pinned"] == 1
    assert m["weightd_adapter_bytes"] == 8 * second_bytes
    assert m["weightd_adapter_budget_bytes"] > m["weightd_adapter_bytes"]
    for n in names:
        admin.pin_adapter(n)  # nothing left to evict: the next load must fail, evicting nothing
    with pytest.raises(ResourceExhaustedError, match="adapter budget"):
        admin.load_adapter("big", str(lora.second_dir))
    assert len(admin.list_adapters()) == 8
    assert delta("weightd_adapter_rejections_total{reason=budget}") == 1

    for s in admin.list_adapters():
        admin.unload_adapter(s.name)
    assert delta("weightd_adapter_unloads_total") == 8
    wait_until(lambda: not adapter_packs(daemon), "adapter packs to be freed")
    m = metrics(daemon)
    for gauge in ("adapters_loaded", "adapter_versions", "adapter_bytes", "adapter_leases"):
        assert m[f"weightd_{gauge}"] == 0, gauge

    text = scrape(daemon.address("metrics"))
    done = subprocess.run(
        [_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout
    assert "adapter=" not in text and 'name="' not in text  # no adapter names as labels


def proc_usage(pid: int) -> tuple[int, int]:
    """(resident kB, open descriptors) of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def test_shm_fetches_race_replace_and_unload(
    lora: Fixture,
    daemon: RunningDaemon,
    admin: AdminClient,
    config: dict[str, object],
) -> None:
    """>= 100 shared-memory fetches while an operator replaces and unloads in a loop:
    each is complete, maps exactly the version it names, and nothing leaks."""
    want = {d: expected(d, 2, 1, config) for d in (lora.adapter_dir, lora.second_dir)}

    def settle() -> None:
        wait_until(lambda: not adapter_packs(daemon), "adapter packs to be freed")
        wait_until(lambda: metrics(daemon)["weightd_adapter_versions"] == 0, "versions freed")

    # A warm-up round, so the baseline includes what the first fetches allocate for good.
    admin.load_adapter("race", str(lora.adapter_dir))
    with WeightClient(daemon.target, timeout=60) as c:
        for _ in range(3):
            c.fetch_adapter("race", 1, 2, transport="shm")
    admin.unload_adapter("race")
    settle()
    rss0, fds0 = proc_usage(daemon.process.pid)

    r = race(daemon.target, admin, "race", want, "shm")
    print(f"race: {len(r.versions)} fetches of {len(set(r.versions))} versions, {r.misses} misses")
    admin.unload_adapter("race")
    settle()
    m = metrics(daemon)
    assert (m["weightd_adapter_leases"], m["weightd_adapter_packs"]) == (0, 0)
    assert admin.list_adapters() == []
    # Connections close just after their leases end: give the daemon a moment, boundedly.
    pid = daemon.process.pid
    wait_until(lambda: proc_usage(pid)[1] <= fds0 + 2, f"the daemon's fds back to {fds0}")
    rss, fds = proc_usage(pid)
    assert rss <= rss0 + 32 * 1024, (rss0, rss)
    print(
        f"daemon RSS {rss0} -> {rss} kB, fds {fds0} -> {fds}"
    )  # kB; each version is ~100 kB, x >= 5


def test_attach_to_an_adapter_pack_holds_its_version(
    lora: Fixture, daemon: RunningDaemon, admin: AdminClient, client: WeightClient
) -> None:
    """A second process's attach (by PackRef) leases the pack *and* its version, which
    may no longer be current; once both holders let go, neither can be attached again."""
    v1 = admin.load_adapter("att", str(lora.adapter_dir))
    first = client.fetch_adapter("att", 0, 2, transport="shm")
    assert first.info is not None and first.info.pack is not None
    ref = first.info.pack
    admin.load_adapter("att", str(lora.second_dir))  # v1 is retired, leased by `first`
    state, info = client.attach(ref)
    assert info.pack is not None and info.pack.adapter is not None
    assert info.pack.adapter.version == v1.version
    assert same_bytes(state, first.tensors)
    del first
    gc.collect()
    wait_until(  # the first lease ends; the attach still holds the pack and v1
        lambda: adapter_packs(daemon).get(("att", v1.version, 0)) == 1, "one lease on v1's pack"
    )
    assert metrics(daemon)["weightd_adapter_versions"] == 2
    del state
    wait_until(lambda: ("att", v1.version, 0) not in adapter_packs(daemon), "v1's pack freed")
    with pytest.raises(FailedPreconditionError, match="does not exist"):
        client.attach(ref)
    admin.unload_adapter("att")
    wait_until(lambda: not adapter_packs(daemon), "adapter packs to be freed")
