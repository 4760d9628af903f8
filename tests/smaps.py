"""What the kernel really did with a pack's pages, read from ``/proc/self/smaps``.

Tests compare the daemon's claims (``HostPack.huge``, a collapse's byte count) with
this, so a claim that the kernel did not honour fails.
"""

from __future__ import annotations

import ctypes

from weightd.client.transports.shm import MADV_POPULATE_READ
from weightd.common.hugemap import address, madvise, map_aligned


def pmd_mapped(mapping: ctypes.Array[ctypes.c_char]) -> int:
    """Bytes of ``mapping`` (from :func:`map_aligned`) mapped with 2 MiB entries now."""
    head = f"{address(mapping):x}-"
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            key = line.split(" ", 1)[0]
            if "-" in key and not key.endswith(":"):
                inside = line.startswith(head)
            elif inside and key in ("ShmemPmdMapped:", "FilePmdMapped:"):
                total += int(line.split()[1]) * 1024
    return total


def pmd_mapped_bytes(fd: int, size: int) -> int:
    """Bytes of ``fd`` that an aligned, populated private mapping maps with 2 MiB entries."""
    mapping = map_aligned(fd, size, shared=False)
    madvise(mapping, MADV_POPULATE_READ)
    return pmd_mapped(mapping)
