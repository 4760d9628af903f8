"""1,000 clients that go away mid-stream, and a slow one: nothing stays behind.

One daemon, out of process, serves the demo model (and a 48 MiB single-tensor model
for the slow consumer). Clients are separate processes (``fault_client.py``): four
run 952 clients that cancel, close their channel, let a deadline expire or drop a
pack lease part-way; two more each hold 12 Fetch streams and 12 pack leases and are
killed with SIGKILL. Afterwards the daemon's descriptors, threads, Fetch streams,
packs, leases and side-socket connections are back to their baseline exactly, and its
resident and private memory within :data:`RSS_TOLERANCE`.

Baseline: taken after a warm-up that runs every kind of client once and holds
``MAX_WORKERS`` streams at once, so gRPC's RPC thread pool (which grows to
``--max-workers`` and never shrinks, by design) is already at its size; packs expire
after ``--pack-ttl 1`` so the baseline holds none.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file

from bench.procstats import fd_targets
from tests.conftest import RunningDaemon, run_daemon
from tests.reliability import fault_client
from tests.reliability.load_support import Snapshot, demo_model, settle, snapshot
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

__all__ = ["demo_model"]  # a fixture, used by name

pytestmark = pytest.mark.e2e

#: Stream slots (``--max-workers``): above the 24 held + 16 polite streams at once, since
#: streams past the slots are refused (RESOURCE_EXHAUSTED), not queued behind the pool.
MAX_WORKERS = 48
POLITE_PROCS, PER_PROC = 4, 238
KILLED_PROCS, HOLD = 2, 12
#: Resident and private memory may differ from the baseline by this much afterwards
#: (allocator free lists, gRPC's per-connection buffers kept for reuse).
RSS_TOLERANCE = 32 << 20
BLOB_BYTES = 48 << 20
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def blob_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 48 MiB tensor (an architecture without rules: served whole at world size 1)."""
    root = tmp_path_factory.mktemp("rel-blob")
    (root / "config.json").write_text(json.dumps({"architectures": ["BlobForTest"]}))
    data = np.random.default_rng(3).integers(0, 255, size=BLOB_BYTES, dtype=np.uint8)
    save_file({"blob": data}, str(root / "model.safetensors"))
    return root


@pytest.fixture(scope="module")
def daemon(
    demo_model: Path, blob_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    extra = [
        "--metrics-listen", "127.0.0.1:0",
        "--pack-ttl", "1",
        "--max-workers", str(MAX_WORKERS),
        "--max-concurrent-rpcs", "400",
    ]  # fmt: skip
    models = [("demo", demo_model), ("blob", blob_model)]
    with run_daemon(tmp_path_factory.mktemp("faults"), models, extra) as d:
        yield d


def _quiet(base: Snapshot | None = None, threads: bool = True) -> Callable[[Snapshot], bool]:
    def ok(s: Snapshot) -> bool:
        idle = s.fetch_streams == 0 and s.packs == 0 and s.leases == 0 and s.side_connections == 0
        if base is None:
            return idle
        same_threads = s.usage.threads == base.usage.threads or not threads
        return idle and s.usage.fds == base.usage.fds and same_threads

    return ok


def _warm_up(daemon: RunningDaemon) -> None:
    """Every kind of client once, then MAX_WORKERS streams held at once (fills the pool)."""
    counts = fault_client.run_clients(daemon.target, 16, 4)
    assert not [k for k in counts if k.startswith("error")], counts
    channels = [
        grpc.insecure_channel(daemon.target, options=fault_client.OPTIONS)
        for _ in range(MAX_WORKERS)
    ]
    calls = [pb_grpc.WeightsStub(c).Fetch(fault_client._request(), timeout=60) for c in channels]
    for call in calls:
        next(call)
    for call, channel in zip(calls, channels, strict=True):
        call.cancel()
        channel.close()


def test_a_thousand_clients_leaving_mid_stream_leave_nothing_behind(
    daemon: RunningDaemon,
) -> None:
    _warm_up(daemon)
    base = settle(daemon, _quiet())
    assert _quiet()(base), base.row()

    polite = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.fault_client", daemon.target,
             "--clients", str(PER_PROC), "--threads", "4"],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        for _ in range(POLITE_PROCS)
    ]  # fmt: skip
    held = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.reliability.fault_client", daemon.target,
             "--hold", str(HOLD)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
        )
        for _ in range(KILLED_PROCS)
    ]  # fmt: skip
    for proc in held:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert json.loads(line) == {"holding": HOLD, "leases": HOLD}, line
    during = snapshot(daemon)
    # Really held: the daemon sees every killed process's streams and leases alive.
    assert during.leases >= KILLED_PROCS * HOLD, during.row()
    assert during.fetch_streams >= KILLED_PROCS * HOLD, during.row()
    for proc in held:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    counts: Counter[str] = Counter()
    for proc in polite:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        counts.update(json.loads(out.strip().splitlines()[-1]))
    errors = {k: v for k, v in counts.items() if k.startswith("error")}
    assert not errors, errors
    per_mode = POLITE_PROCS * (PER_PROC // len(fault_client.MODES))
    assert all(counts[m] >= per_mode for m in fault_client.MODES), counts
    assert sum(counts[m] for m in fault_client.MODES) == POLITE_PROCS * PER_PROC, counts
    assert counts["deadline-DEADLINE_EXCEEDED"] == counts["deadline"], counts
    clients = sum(counts[m] for m in fault_client.MODES) + KILLED_PROCS * 2 * HOLD
    assert clients >= 1000

    after = settle(daemon, _quiet(base))
    print(f"\n{clients} clients: {dict(counts)}\nbaseline: {base.row()}\nduring:   "
          f"{during.row()}\nafter:    {after.row()}")  # fmt: skip
    assert after.fetch_streams == 0 and after.leases == 0 and after.packs == 0, after.row()
    assert after.side_connections == 0, after.row()
    assert after.usage.fds == base.usage.fds, f"{base.row()} -> {after.row()}"
    assert after.usage.threads == base.usage.threads, f"{base.row()} -> {after.row()}"
    assert after.usage.rss_bytes <= base.usage.rss_bytes + RSS_TOLERANCE, after.row()
    assert after.usage.private_bytes <= base.usage.private_bytes + RSS_TOLERANCE, after.row()
    # And it still serves, correctly (the client checks every digest).
    with grpc.insecure_channel(daemon.target) as channel:
        replies = list(pb_grpc.WeightsStub(channel).Fetch(fault_client._request(), timeout=60))
    assert replies[-1].HasField("done") and replies[-1].done.num_tensors > 0


def test_slow_consumer_is_held_back_by_flow_control_not_buffered(daemon: RunningDaemon) -> None:
    request = pb.FetchRequest(
        model="blob", layout=pb.Layout(tp_size=1, tp_rank=0), max_chunk_bytes=64 << 10
    )
    # One full read first: the tensor's first request also anchors its digest (reads and
    # hashes it whole, once), which is not what this test measures.
    with grpc.insecure_channel(daemon.target) as channel:
        assert list(pb_grpc.WeightsStub(channel).Fetch(request, timeout=120))[-1].done.num_tensors
    base = settle(daemon, _quiet())
    base_fds = fd_targets(daemon.process.pid)
    peak = base.usage
    got = 0
    with grpc.insecure_channel(daemon.target, options=fault_client.OPTIONS) as channel:
        call = pb_grpc.WeightsStub(channel).Fetch(request, timeout=120)
        for response in call:  # about 3 s of reading 64 KiB every 50 ms
            got += sum(len(c.data) for c in response.chunks)
            now = snapshot(daemon).usage
            peak = max(peak, now, key=lambda u: u.rss_bytes)
            if got >= 64 * (64 << 10):
                break
            time.sleep(0.05)
        # Meanwhile another client is served in full.
        done = threading.Event()

        def other() -> None:
            with grpc.insecure_channel(daemon.target) as c:
                replies = list(pb_grpc.WeightsStub(c).Fetch(fault_client._request(), timeout=60))
            if replies[-1].HasField("done"):
                done.set()

        t = threading.Thread(target=other)
        t.start()
        t.join(60)
        assert done.is_set()
        call.cancel()
    grown = peak.rss_bytes - base.usage.rss_bytes
    print(
        f"\nslow consumer: read {got >> 10} KiB of {BLOB_BYTES >> 20} MiB; daemon RSS "
        f"{base.usage.rss_bytes >> 20} -> peak {peak.rss_bytes >> 20} MiB (+{grown >> 20})"
    )
    # Flow control holds the daemon back: it never reads ahead the 48 MiB it would send.
    assert grown < 16 << 20, (base.usage, peak)
    after = settle(daemon, _quiet(base, threads=False))  # the RPC pool may have grown
    assert after.fetch_streams == 0, after.row()
    assert after.usage.fds == base.usage.fds, (base_fds, fd_targets(daemon.process.pid))
