"""Keeps bench/load_into.py working: a tiny run end to end (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_load_into_bench_runs_every_row_and_checks_the_module(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "bench/load_into.py",
            "--smoke",
            "--size-mb",
            "4",
            "--repeat",
            "1",
            "--dir",
            str(tmp_path / "ckpt"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = done.stdout.split("median of 1:")[-1]
    # Each row names the transport that actually served it.
    for row, via in [("fetch+copy", "grpc"), ("load_into", "grpc"), ("load_into-shm", "shm")]:
        assert re.search(rf"\n  {re.escape(row)} +{via} ", table), table
    assert "held exactly the rank's bytes" in table
