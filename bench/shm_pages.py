"""What huge pages do for a shared-memory fetch: seconds per GiB until a pack is resident.

A worker that maps a rank pack pays one page-table entry per page the first time it
reads it; with 4 KiB pages that is all that is left of a shared-memory fetch
(docs/notes/2026-12-02-grpc-throughput.md). Packs are memfds, so huge pages for them are shmem THP,
governed by ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``, a host-wide
setting. This benchmark allocates a pack-sized memfd the way ``packs/build.py`` does
for each mode (``packs/hugepages.allocate``: fallocate, advice plus
``MADV_POPULATE_WRITE`` under ``advise``, a collapse into huge pages first under
``never``), maps it as the client maps packs (``MAP_PRIVATE``, 2 MiB-aligned) in a
fresh child process, and times reading one byte of
every page, lazily and after ``MADV_POPULATE_READ``.

``--modes never,advise`` compares the modes in one run, alternating: it sets the
host's ``shmem_enabled`` for each measurement and restores the original value at the
end, so it needs root and a writable sysfs (it says so and stops otherwise). Without
``--modes`` it measures the current mode only.

    sudo .venv/bin/python bench/shm_pages.py --modes never,advise --size-gib 1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from weightd.common.hugemap import madvise, map_aligned
from weightd.server.packs.hugepages import allocate

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.shmem import SHMEM_ENABLED, can_set_modes, host_mode, set_host_mode

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
PAGE = 4096


def child(size: int) -> None:
    """Allocate a pack as the daemon would in this mode, then read it as a worker would."""
    mode = host_mode()
    fd = os.memfd_create("weightd-bench-pack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    writer = map_aligned(fd, size, shared=True)  # as packs/build.py fills a pack
    allocate(writer, fd, size, mode, 4)
    pages = np.frombuffer(writer, dtype=np.uint8)
    pages[::PAGE] = 1
    del pages, writer
    huge_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("ShmemHugePages:"):
                huge_kb = int(line.split()[1])
    out = {"mode": mode, "shmem_huge_gib": huge_kb / 2**20}
    for how in ("touch", "populate"):
        reader = map_aligned(fd, size, shared=False)  # as client/transports/shm.py maps
        view = np.frombuffer(reader, dtype=np.uint8)
        started = time.perf_counter()
        if how == "populate":
            madvise(reader, MADV_POPULATE_READ)
        total = int(view[::PAGE].sum())
        out[how] = (time.perf_counter() - started) / (size / 2**30)
        assert total == size // PAGE
        del view, reader
    os.close(fd)
    print(json.dumps(out), flush=True)


def measure(size: int) -> dict[str, float | str]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", "--size-bytes", str(size)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, float | str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modes", default="", help="e.g. never,advise (sets shmem_enabled; root)")
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.size_bytes)
        return 0
    size = int(args.size_gib * 2**30) // (2 << 20) * (2 << 20)  # whole huge pages
    original = host_mode()
    modes = [m for m in args.modes.split(",") if m] or [original]
    if modes != [original] and not can_set_modes():
        print(f"--modes needs root and a writable {SHMEM_ENABLED}", file=sys.stderr)
        return 2
    rows: dict[str, list[dict[str, float | str]]] = {m: [] for m in modes}
    try:
        for _ in range(args.rounds):
            for mode in modes:  # alternating: the machine's noise falls on every mode
                if mode != host_mode():
                    set_host_mode(mode)
                rows[mode].append(measure(size))
    finally:
        if host_mode() != original:
            set_host_mode(original)
    print(f"{size / 2**30:.2f} GiB pack, {args.rounds} rounds, shmem_enabled was {original}")
    print("| shmem_enabled | huge pages (GiB) | touch s/GiB (median) | populate+touch s/GiB |")
    print("|---|---|---|---|")
    base = None
    for mode, got in rows.items():
        touch = statistics.median(float(r["touch"]) for r in got)
        populate = statistics.median(float(r["populate"]) for r in got)
        huge = max(float(r["shmem_huge_gib"]) for r in got)
        base = base or touch
        print(f"| {mode} | {huge:.2f} | {touch:.3f} ({touch / base:.2f}x) | {populate:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
