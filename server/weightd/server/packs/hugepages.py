"""Huge pages for rank packs, where the kernel allows them for shared memory.

Why: a worker mapping a pack pays one page-table entry per 4 KiB page the first time
it reads it, ~0.25-0.3 s per GiB here, which is all that is left of a shared-memory
fetch; a pack in 2 MiB pages is mapped with 512 times fewer entries. Packs are memfds,
i.e. shmem, whose transparent huge pages are governed by
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (not by the anonymous-memory
setting):

* ``always``, ``within_size``, ``force``: the kernel gives a pack huge pages by itself
  when :func:`~.build.build_pack` allocates it (``posix_fallocate``);
* ``advise``: only pages faulted through a mapping advised ``MADV_HUGEPAGE`` are huge,
  so the pack is allocated through its writer mapping instead (advice, then
  ``MADV_POPULATE_WRITE``, which fails with an error, never SIGBUS, when memory runs
  out);
* ``never``, ``deny``, or no such file (no THP): 4 KiB pages, as before.

This machine says ``never`` (and cannot be changed from here), so only the fallback is
measured; the advise path is exercised for correctness by forcing the mode in tests.
"""

from __future__ import annotations

import logging
import mmap
from functools import cache
from typing import Final

log = logging.getLogger("weightd.packs")

SHMEM_ENABLED: Final = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
#: Modes in which shmem gets huge pages without any advice.
BY_ITSELF: Final = frozenset({"always", "within_size", "force"})
ADVISE: Final = "advise"
MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE: Final = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def parse_mode(text: str) -> str:
    """The selected mode of a sysfs THP setting (``"always [never] ..."`` -> never); pure."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "never"


def read_mode(path: str = SHMEM_ENABLED) -> str:
    """The shmem THP mode as the file says it now ("never" when unreadable: no THP)."""
    try:
        with open(path) as f:
            return parse_mode(f.read())
    except OSError:
        return "never"


@cache
def shmem_mode(path: str = SHMEM_ENABLED) -> str:
    """This kernel's shmem THP mode, read once (the daemon's packs follow it), logged once."""
    mode = read_mode(path)
    how = (
        "huge pages by the kernel"
        if mode in BY_ITSELF
        else "huge pages by advice"
        if mode == ADVISE
        else "4 KiB pages"
    )
    log.info("rank packs: shmem_enabled=%s: %s", mode, how)
    return mode


def allocate_by_advice(mode: str) -> bool:
    """Whether packs must be allocated through an advised mapping (pure)."""
    return mode == ADVISE


def huge_by_itself(mode: str) -> bool:
    """Whether the kernel gives shmem huge pages in ``mode`` without advice (pure)."""
    return mode in BY_ITSELF


def advise_and_allocate(writer: mmap.mmap) -> bool:
    """Ask for huge pages on ``writer``, then allocate every page of it now.

    The advice is best effort (a kernel without THP refuses it: 4 KiB pages then, and
    False is returned); the allocation is not: ``OSError`` (ENOMEM, EFAULT) propagates
    for the caller to report as a shortage.
    """
    advised = True
    try:
        writer.madvise(MADV_HUGEPAGE)
    except OSError as exc:
        log.debug("MADV_HUGEPAGE refused (%s); the pack uses 4 KiB pages", exc)
        advised = False
    writer.madvise(MADV_POPULATE_WRITE)
    return advised
