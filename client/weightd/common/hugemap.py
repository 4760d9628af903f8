"""Mapping a memfd at a 2 MiB-aligned address, so its huge pages can be mapped huge.

Why: a shmem page that is a 2 MiB folio is mapped with one PMD entry only where the
mapping's address and file offset agree modulo 2 MiB. The kernel picks such an
address by itself only while ``shmem_enabled`` is not ``never``; on a host left at
``never`` a pack collapsed into huge pages (``packs/hugepages.py``) would still be
mapped 4 KiB at a time by a mapping from Python's :mod:`mmap`, which cannot ask for
an address. So this reserves ``size + 2 MiB`` of address space (``PROT_NONE``,
nothing committed), maps the file over the aligned part of the reservation
(``MAP_FIXED`` over our own reservation, so nothing else can be replaced), and
unmaps the rest.

Lifetime is the buffer object's: :func:`map_aligned` returns a ctypes byte array
viewing the mapping, and the mapping is unmapped when that array is freed (a
finalizer), never before. Everything that uses the bytes (``memoryview``,
``torch.frombuffer``, numpy) keeps a reference to the array, so no view can outlive
the mapping; there is deliberately no explicit ``close``.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref
from typing import Final

from .libc import libc

#: The PMD huge page size on x86-64 and arm64 (4 KiB base pages).
HUGE_PAGE: Final = 2 << 20
_MAP_FIXED: Final = 0x10
_PROT_NONE: Final = 0
_MAP_NORESERVE: Final = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED: Final = ctypes.c_void_p(-1).value


def _raise(what: str) -> None:
    code = ctypes.get_errno() or errno.EINVAL
    raise OSError(code, f"{what}: {os.strerror(code)}")


def map_aligned(fd: int, size: int, *, shared: bool) -> ctypes.Array[ctypes.c_char]:
    """``fd``'s first ``size`` bytes, readable and writable, mapped at a 2 MiB boundary.

    ``shared``: ``MAP_SHARED`` (writes reach the file: the daemon's one writer of a
    pack) or ``MAP_PRIVATE`` (copy-on-write: a client's view of a sealed pack).
    Raises ``OSError`` (a size of 0 is EINVAL, as for :mod:`mmap`).
    """
    if size <= 0:
        raise OSError(errno.EINVAL, f"cannot map {size} bytes")
    lib = libc()
    span = size + HUGE_PAGE
    base = lib.mmap(
        None, span, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0
    )
    if base is None or base == _MAP_FAILED:
        _raise(f"reserving {span} bytes of address space")
    assert base is not None
    start = (base + HUGE_PAGE - 1) & -HUGE_PAGE
    flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | _MAP_FIXED
    got = lib.mmap(start, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if got != start:
        lib.munmap(base, span)
        _raise(f"mapping {size} bytes of descriptor {fd}")
    # Give back the reservation on either side (page-granular: the mapping's end is
    # rounded up to a page by the kernel, so the tail starts at the next page).
    end = start + ((size + mmap.PAGESIZE - 1) & -mmap.PAGESIZE)
    if start > base:
        lib.munmap(base, start - base)
    if base + span > end:
        lib.munmap(end, base + span - end)
    array = (ctypes.c_char * size).from_address(start)
    weakref.finalize(array, lib.munmap, start, end - start)
    return array


def address(array: ctypes.Array[ctypes.c_char]) -> int:
    return ctypes.addressof(array)


def madvise(
    array: ctypes.Array[ctypes.c_char], advice: int, offset: int = 0, length: int = -1
) -> None:
    """``madvise`` on the whole pages of ``[offset, offset + length)``; ``OSError`` on refusal."""
    size = len(array) if length < 0 else length
    start = address(array) + offset
    first = (start + mmap.PAGESIZE - 1) & -mmap.PAGESIZE
    stop = (start + size) & -mmap.PAGESIZE if offset + size < len(array) else start + size
    if stop <= first:
        return
    if libc().madvise(first, stop - first, advice) != 0:
        _raise(f"madvise({advice}) on {stop - first} bytes")
