"""Keeps the benchmark working: a tiny run end to end (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run import available_peers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_bench_smoke_run_produces_table_json_and_chart(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--smoke",
            "--size-gb",
            "0.01",
            "--rounds",
            "1",
            "--world-sizes",
            "2",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    peers = available_peers()  # Run:ai's streamer and fastsafetensors when installed
    assert f"all {len(peers) + 3} cases deliver identical slices" in done.stdout
    (run,) = (tmp_path / "out").iterdir()
    result = json.loads((run / "results.json").read_text())
    cases = {(r["case"], r["cache"]) for r in result["rows"]}
    for case in (
        *peers,
        "weightd-grpc-unix",
        "weightd-grpc-tcp",
        "weightd-shm",
    ):
        assert (case, "first") in cases
    assert all(r["payload_bytes"] > 0 for r in result["rows"])
    # No rank measures or exits (taking cores from ranks still loading) before all are done.
    for run_ in result["raw"]:
        ranks = run_["ranks"]
        assert min(r["released"] for r in ranks) >= max(r["done"] for r in ranks), run_["case"]
    # Time until every page is resident: what the kernel showed mapped is not touched.
    assert result["meta"]["until"] == "resident"
    assert all(0 <= r["proven_resident_bytes"] <= r["payload_bytes"] for r in result["rows"])
    for r in result["rows"]:
        if r["case"].startswith("weightd-grpc"):  # received into tensors it wrote: resident
            assert r["proven_resident_bytes"] == r["payload_bytes"], r
    assert (run / "chart.png").stat().st_size > 1000
    assert "Ratios" in (run / "results.md").read_text()
