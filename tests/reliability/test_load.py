"""32 client processes fetch every rank, over and over, past the daemon's concurrency
limit: every fetch completes and is bit-exact; the only refusals are the deliberate
RESOURCE_EXHAUSTED, which the clients' retry policy absorbs. Also a few seconds of the
soak command (``bench/soak.py``), with a client kill and a SIGKILL restart.

Throughput and latency are printed in the test output, never asserted: the machine is
shared. The figures of long runs are in ``docs/notes/2026-12-02-soak.md``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from bench.loadgen import ClientSpec, mismatch, reference_slices, run_load
from tests.conftest import run_daemon
from tests.reliability.load_support import demo_model
from weightd.client import ResourceExhaustedError, RetryPolicy, WeightClient
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

__all__ = ["demo_model"]  # a fixture, used by name

pytestmark = pytest.mark.e2e

CLIENTS = 32
LIMIT = 8  # --max-concurrent-rpcs, well below CLIENTS: the limit is really hit
SECONDS = 10.0
ROOT = Path(__file__).resolve().parents[2]


def test_32_client_processes_get_every_rank_right_past_the_concurrency_limit(
    demo_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--max-concurrent-rpcs", str(LIMIT), "--max-workers", str(LIMIT)]
    with run_daemon(tmp_path, [("demo", demo_model)], extra) as daemon:
        specs = [ClientSpec(daemon.target, str(demo_model), offset=i) for i in range(CLIENTS)]
        report = run_load(specs, SECONDS)
        assert daemon.process.poll() is None, daemon.log()
    summary = report.summary()
    with capsys.disabled():  # the figures belong in the test output, even without -s
        print(f"\nload: {json.dumps(summary)}")
    assert not report.errors, report.error_details
    assert not report.mismatches, report.mismatches[:5]
    assert report.ok == report.fetches >= CLIENTS
    # Every rank of every world size was fetched (1 + 2 + 4 layouts).
    assert sorted(report.by_layout) == ["0/1", "0/2", "0/4", "1/2", "1/4", "2/4", "3/4"]
    # The limit was really hit, and refusals were retried, never anything else.
    assert report.retries["RESOURCE_EXHAUSTED"] > 0, report.retries
    assert set(report.retries) <= {"RESOURCE_EXHAUSTED", "UNAVAILABLE"}


def test_soak_command_smoke(tmp_path: Path) -> None:
    out = tmp_path / "soak.md"
    done = subprocess.run(
        [
            sys.executable, "-m", "bench.soak", "--duration", "6", "--clients", "4",
            "--kill-every", "2", "--restart-at", "0.4", "--restart-signal", "kill",
            "--work-dir", str(tmp_path / "work"), "--report", str(out),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["ok"] == summary["fetches"] > 0 and summary["mismatches"] == 0
    assert summary["clients_killed"] >= 2 and not summary["errors"]
    assert summary["clients_lost"] == []  # no client crashed
    assert summary["retries"].get("UNAVAILABLE", 0) > 0  # the restart was seen and retried
    text = out.read_text()
    needles = (
        "restarted 1 time(s) mid-run (SIGKILL)",
        "fetch latency p50 / p99 / max",
        "daemon at start",
        "daemon at end",
        "errors (after retries) | none",
    )
    for needle in needles:
        assert needle in text, text


def test_the_limit_refuses_with_resource_exhausted_and_the_policy_waits_it_out(
    demo_model: Path, tmp_path: Path
) -> None:
    """Deterministically: LIMIT streams held open fill the daemon; a client without a
    policy is refused at once, one with a policy backs off until a slot frees."""
    extra = ["--max-concurrent-rpcs", str(LIMIT), "--max-workers", str(LIMIT)]
    with run_daemon(tmp_path, [("demo", demo_model)], extra) as daemon:
        options = [("grpc.http2.bdp_probe", 0)]
        channels = [grpc.insecure_channel(daemon.target, options=options) for _ in range(LIMIT)]
        request = pb.FetchRequest(layout=pb.Layout(tp_size=1, tp_rank=0), max_chunk_bytes=16 << 10)
        calls = [pb_grpc.WeightsStub(c).Fetch(request, timeout=120) for c in channels]
        for call in calls:
            next(call)  # each holds one of the LIMIT slots, blocked on flow control
        with (
            WeightClient(daemon.target, timeout=60) as plain,
            pytest.raises(ResourceExhaustedError),
        ):
            plain.fetch(0, 2, transport="grpc")
        policy = RetryPolicy(initial_backoff=0.05, max_backoff=0.2, total_seconds=60)
        with WeightClient(daemon.target, timeout=60, retry=policy) as patient:
            release = threading.Timer(1.0, lambda: [c.cancel() for c in calls])
            release.start()
            state = patient.fetch(0, 2, transport="grpc")
            release.join()
            assert patient.retry_stats.retries["RESOURCE_EXHAUSTED"] >= 2, patient.retry_stats
            assert set(patient.retry_stats.retries) == {"RESOURCE_EXHAUSTED"}
            assert patient.retry_stats.waited_seconds >= 0.5
        for channel in channels:
            channel.close()
    assert state and not mismatch(state, reference_slices(str(demo_model), 2, 0))
