"""Keeps bench/grpc_throughput.py working: a tiny run end to end (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_grpc_throughput_bench_runs_every_row_it_can_without_history(tmp_path: Path) -> None:
    # The "before" rows need the baseline commit's history; the others run anywhere.
    rows = "bare-raw,bare-pb,after-sha256,after,after-rehash,after-into,streams-2"
    done = subprocess.run(
        [
            sys.executable,
            "bench/grpc_throughput.py",
            "--smoke",
            "--size-mb",
            "4",
            "--repeat",
            "1",
            "--rows",
            rows,
            "--dir",
            str(tmp_path / "ckpt"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("median of 1")[-1]
    for row in rows.split(","):
        assert f"\n  {row} " in table


@pytest.mark.e2e
def test_grpc_throughput_bench_pins_each_side_to_its_own_core(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "bench/grpc_throughput.py",
            "--smoke",
            "--size-mb",
            "4",
            "--repeat",
            "1",
            "--rows",
            "bare-raw,after",
            "--pin",
            "--dir",
            str(tmp_path / "ckpt"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("median of 1")[-1]
    assert "\n  bare-raw " in table and "\n  after " in table
    assert "a core for each side" in table
