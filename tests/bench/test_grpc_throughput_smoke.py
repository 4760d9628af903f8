"""Keeps bench/grpc_throughput.py working: a tiny run end to end (no timing is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _table(tmp_path: Path, rows: str, *extra: str) -> str:
    """The result table of a tiny run of ``rows`` (one repeat); the run must succeed."""
    command = [sys.executable, "bench/grpc_throughput.py", "--smoke", "--size-mb", "4"]
    command += ["--repeat", "1", "--rows", rows, "--dir", str(tmp_path / "ckpt"), *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("median of 1")[-1]
    for row in rows.split(","):
        assert f"\n  {row} " in table
    return table


@pytest.mark.e2e
def test_grpc_throughput_bench_runs_every_row_it_can_without_history(tmp_path: Path) -> None:
    # The "before" rows need the baseline commit's history; the others run anywhere.
    rows = "bare-raw,bare-pb,after-sha256,after,after-rehash,after-into,streams-2"
    table = _table(tmp_path, rows)
    assert "overlapped perfectly" in table  # the two-cores cap, both sides sharing them
    # Each row's busiest thread on both sides was read, and its thread cap follows.
    threads = table.split("Busiest thread")[1].splitlines()
    for row in rows.split(","):
        line = next(x for x in threads if x.startswith(f"  {row} "))
        client, server, cap = (float(v) for v in line.split()[1:4])
        assert client > 0 and server > 0, line
        assert cap == pytest.approx(1 / max(client, server), rel=0.05, abs=0.01), line


@pytest.mark.e2e
def test_grpc_throughput_bench_pins_each_side_to_its_own_core(tmp_path: Path) -> None:
    # The script itself fails a row whose client or server threads left their core.
    table = _table(tmp_path, "bare-raw,after", "--pin")
    assert "a core for each side" in table
