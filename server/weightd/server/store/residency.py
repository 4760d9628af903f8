"""How much of a file is in the page cache, asked of the kernel with ``mincore``.

Why a mapping, and why it is safe: ``mincore`` reports residency for the pages of a
*mapping*, so each shard is mapped read-only for the duration of one question and
unmapped straight after. Nothing ever reads through that mapping (tensor bytes are
read with ``pread`` by the store), and ``mincore`` itself never faults a page in, so
a file truncated under the daemon cannot raise SIGBUS here. The length mapped is the
file's size *now* (``fstat``), never the size it had when verified, so a shrunken
file is simply clamped. Big files are asked about in windows so the residency vector
stays small (one byte per 4 KiB page: 256 KiB per GiB).

Linux only (``mincore`` and ``mmap`` through ``ctypes`` on libc).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Final

import numpy as np

from weightd.common.libc import libc

#: Bytes mapped per ``mincore`` call; its vector is WINDOW_BYTES / page size bytes.
WINDOW_BYTES: Final = 1 << 30
PAGE_BYTES: Final = mmap.PAGESIZE

_MAP_FAILED: Final = ctypes.c_void_p(-1).value


class ResidencyUnavailable(OSError):
    """``mincore`` cannot be asked (not Linux, or libc lacks it); metrics skip the series."""


def _lib() -> ctypes.CDLL:
    try:
        return libc()
    except (OSError, AttributeError) as exc:
        raise ResidencyUnavailable(f"libc's mmap/mincore are unavailable: {exc}") from None


def pages_for(length: int, page_bytes: int = PAGE_BYTES) -> int:
    """Pages a mapping of ``length`` bytes spans (pure)."""
    return -(-length // page_bytes)


def resident_bytes_from_vector(vec: bytes | bytearray, length: int, page_bytes: int) -> int:
    """Resident bytes of a ``length``-byte mapping from ``mincore``'s vector (pure).

    Only the low bit of each entry means "resident" (the rest are reserved). The last
    page counts only the part of it that lies inside the file.
    """
    pages = pages_for(length, page_bytes)
    if len(vec) < pages:
        raise ValueError(f"mincore vector has {len(vec)} entries, {pages} pages mapped")
    if pages == 0:
        return 0
    flags = np.frombuffer(bytes(vec[:pages]), dtype=np.uint8) & 1
    resident = int(np.count_nonzero(flags)) * page_bytes
    if flags[-1]:
        resident -= pages * page_bytes - length  # the tail of the last page is not file
    return resident


def windows(size: int, window: int = WINDOW_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces covering ``size`` bytes; offsets are page aligned (pure)."""
    if window % PAGE_BYTES:
        raise ValueError(f"window {window} is not a multiple of the page size {PAGE_BYTES}")
    return [(off, min(window, size - off)) for off in range(0, size, window)]


def resident_bytes(fd: int, size: int | None = None) -> tuple[int, int]:
    """``(mapped, resident)`` bytes of the open file ``fd``, from ``mincore``.

    ``size`` is an upper bound (the size the caller believes the file has); the file's
    current size always wins when it is smaller, so a file that shrank is clamped.
    """
    lib = _lib()
    current = os.fstat(fd).st_size
    length = current if size is None else min(size, current)
    total = 0
    for off, n in windows(length):
        addr = lib.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap for mincore: {os.strerror(err)}")
        try:
            vec = (ctypes.c_ubyte * pages_for(n))()
            if lib.mincore(addr, n, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore: {os.strerror(err)}")
            total += resident_bytes_from_vector(bytes(vec), n, PAGE_BYTES)
        finally:
            lib.munmap(addr, n)
    return length, total


def drop_cached(fd: int) -> None:
    """Ask the kernel to drop the file's pages from the page cache.

    ``POSIX_FADV_DONTNEED`` frees only clean pages no process maps: it never loses data
    and never changes what a later read returns (that read goes to the disk instead).
    Pages not yet written back (a checkpoint just downloaded or copied) are not clean,
    so the file is flushed first (``fdatasync`` works on a read-only descriptor; where
    it is refused, only the clean pages go). Used once a model's packs are its
    resident copy.
    """
    with contextlib.suppress(OSError):
        os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
