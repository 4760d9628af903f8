"""Keeps bench/oms_startup.py working: a tiny checkpoint, one round (no timing is
asserted; the figures are in docs/notes/2026-12-07-oms-startup.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_oms_startup_bench_runs_both_trust_roots(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.oms_startup", "--dir", str(tmp_path / "work"),
         "--size", str(8 << 20), "--rounds", "1", "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads((tmp_path / "out" / "oms_startup.json").read_text())
    assert set(out["seconds"]) == {"manifest", "oms"}
    assert all(len(v) == 1 and v[0] > 0 for v in out["cpu_seconds"].values())
    assert set(out["import_cpu_seconds_median"]) == {"base", "weightd", "eager"}
