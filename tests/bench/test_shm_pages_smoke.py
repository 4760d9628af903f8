"""Keeps bench/shm_pages.py working: the host's current mode, a small pack (no timing
is asserted; it never changes ``shmem_enabled`` without ``--modes``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from weightd.server.packs.hugepages import read_mode

ROOT = Path(__file__).resolve().parents[2]


def test_shm_pages_bench_measures_the_current_mode_and_leaves_it() -> None:
    before = read_mode()
    done = subprocess.run(
        [sys.executable, "bench/shm_pages.py", "--size-gib", "0.03", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = [line for line in done.stdout.splitlines() if line.startswith(f"| {before} |")]
    touch, populate = (float(cell.split()[0]) for cell in row.strip("|").split("|")[2:4])
    assert touch > 0 and populate > 0
    assert read_mode() == before
