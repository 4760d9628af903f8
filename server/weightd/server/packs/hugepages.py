"""Huge pages for rank packs, where the kernel allows them for shared memory.

Why: a worker mapping a pack pays one page-table entry per 4 KiB page the first time
it reads it, which is all that is left of a shared-memory fetch (measured in the
dated notes under ``docs/notes/``); a pack in 2 MiB pages is mapped with 512 times
fewer entries. Packs are memfds, i.e. shmem, whose transparent huge pages are governed by
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (not by the anonymous-memory
setting):

* ``always``, ``within_size``, ``force``: the kernel gives a pack huge pages by itself
  when :func:`~.build.build_pack` allocates it (``posix_fallocate``);
* ``advise``: only pages faulted through a mapping advised ``MADV_HUGEPAGE`` are huge,
  so the pack is allocated through its writer mapping instead (advice, then
  ``MADV_POPULATE_WRITE``, which fails with an error, never SIGBUS, when memory runs
  out);
* ``never`` (most distributions' default, and this machine's): the pack is collapsed
  into huge pages (``MADV_COLLAPSE``, Linux 6.1+), which the kernel documents as
  independent of the sysfs setting: it is how a process asks for huge pages where the
  host did not opt in. Before the fill only while that is cheap (free 2 MiB pages
  to be had: :data:`CHEAP_COLLAPSE_RATE`); the rest *after* the pack is built and
  sealed, in the background (:func:`collapse_sealed`): finding 2 MiB pages on a host
  whose memory is full of page cache means reclaim and compaction, which can cost
  more than the whole rest of a build (dated note: 2026-12-08-pack-build), so those are
  built, checked and published in 4 KiB pages (``posix_fallocate``), and upgraded
  while the pack serves. The collapse preserves the bytes (the kernel copies them into the
  huge page) and every mapping stays valid: the sealed content cannot change. Built
  with ``defer_collapse=False``, each 2 MiB block of the empty pack gets one written
  page first (the kernel refuses to collapse a block that has none), then the
  collapse allocates a zeroed 2 MiB page around it before the fill. Blocks the
  kernel cannot collapse (no free 2 MiB page, an older kernel: EINVAL) keep 4 KiB
  pages;
* ``deny`` (the operator's "not even on request"), or no THP: 4 KiB pages.

Clients map huge packs at 2 MiB-aligned addresses (``weightd.common.hugemap``): with
``never`` the kernel would not align a shmem mapping by itself.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Final

from weightd.common.hugemap import HUGE_PAGE, madvise, map_aligned

log = logging.getLogger("weightd.packs")

SHMEM_ENABLED: Final = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
#: Modes in which shmem gets huge pages without any advice.
BY_ITSELF: Final = frozenset({"always", "within_size", "force"})
ADVISE: Final = "advise"
MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE: Final = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: ``MADV_COLLAPSE`` (Linux 6.1, <asm-generic/mman-common.h>).
MADV_COLLAPSE: Final = getattr(mmap, "MADV_COLLAPSE", 25)
#: Modes in which the daemon collapses its packs itself.
COLLAPSE: Final = frozenset({"never"})
#: Collapsing before the fill goes on while it allocates at least this many bytes per
#: CPU second: free 2 MiB pages are being found. Below it (reclaim and compaction, on a
#: host whose memory is page cache: docs/notes/2026-12-08-pack-build.md) a block costs
#: more than 4 KiB pages and their faults during the fill, so the rest is collapsed
#: after the build, off the critical path.
CHEAP_COLLAPSE_RATE: Final = 2e9
#: Blocks collapsed before the rate is judged (a first block pays one-off costs).
RATE_WARMUP_BLOCKS: Final = 8


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
        else "huge pages by collapse"
        if mode in COLLAPSE
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


def collapse_on_request(mode: str) -> bool:
    """Whether packs are collapsed into huge pages by the daemon in ``mode`` (pure)."""
    return mode in COLLAPSE


def collapse(
    fd: int, writer: ctypes.Array[ctypes.c_char], threads: int, min_rate: float = 0.0
) -> int:
    """Collapse every whole 2 MiB block of the empty pack behind ``writer``; bytes collapsed.

    ``writer`` maps ``fd`` from offset 0 at a 2 MiB-aligned address. Best effort: a
    block the kernel refuses keeps 4 KiB pages; the first EINVAL (no MADV_COLLAPSE for
    shmem in this kernel) stops the rest. A block costs milliseconds of page allocation
    (more on a virtual machine, where the hypervisor allocates too), so blocks go to
    ``threads`` threads (ctypes releases the GIL).

    ``min_rate`` (bytes per second, 0: none): stop once, past the first
    :data:`RATE_WARMUP_BLOCKS`, the collapse costs more CPU than that (the kernel's
    time on the calling threads, not wall time, which a loaded host stretches): free
    2 MiB pages have run out and each block now costs reclaim and compaction (the rest is left in
    4 KiB pages, for :func:`collapse_sealed` to upgrade after the build).
    """
    blocks = list(range(0, len(writer) // HUGE_PAGE * HUGE_PAGE, HUGE_PAGE))
    if not blocks:
        return 0
    for off in blocks:
        os.pwrite(fd, b"\0", off)  # a block with no page at all is refused (EINVAL)
    unsupported = False
    slow = False
    spent = [0, 0.0]  # bytes collapsed, CPU seconds they cost (every thread's)

    def one(off: int) -> int:
        nonlocal unsupported, slow
        if unsupported or slow:
            return 0
        cpu = time.thread_time()  # CPU, not wall time: a loaded host's waits are not cost
        try:
            madvise(writer, MADV_COLLAPSE, off, HUGE_PAGE)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                unsupported = True
            return 0
        finally:
            spent[1] += time.thread_time() - cpu  # racy sums are fine: they decide a stop
        spent[0] += HUGE_PAGE
        if min_rate > 0 and spent[0] >= RATE_WARMUP_BLOCKS * HUGE_PAGE:
            slow = spent[0] < min_rate * spent[1]
        return HUGE_PAGE

    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="weightd-pack-huge") as pool:
        done = sum(pool.map(one, blocks))
    if done < len(blocks) * HUGE_PAGE:
        log.info(
            "rank pack: %d of %d MiB collapsed into huge pages (the rest: 4 KiB pages)",
            done >> 20,
            (len(blocks) * HUGE_PAGE) >> 20,
        )
    return done


def advise_and_allocate(writer: ctypes.Array[ctypes.c_char]) -> bool:
    """Ask for huge pages on ``writer``, then allocate every page of it now.

    The advice is best effort (a kernel without THP refuses it: 4 KiB pages then, and
    False is returned); the allocation is not: ``OSError`` (ENOMEM, EFAULT) propagates
    for the caller to report as a shortage.
    """
    advised = True
    try:
        madvise(writer, MADV_HUGEPAGE)
    except OSError as exc:
        log.debug("MADV_HUGEPAGE refused (%s); the pack uses 4 KiB pages", exc)
        advised = False
    madvise(writer, MADV_POPULATE_WRITE)
    return advised


def collapse_sealed(fd: int, size: int, stop: Callable[[], bool]) -> int:
    """Collapse the built (sealed, or at least filled) pack ``fd`` into huge pages; bytes
    collapsed. Best effort, one 2 MiB block at a time, stopping early when ``stop()``
    says so (the pack was freed) or at the first EINVAL (no ``MADV_COLLAPSE`` for shmem).

    Through a private mapping of our own: a sealed memfd refuses a shared writable
    one, and a private one is never written here, so it stays a window onto the
    file's pages, which are what is collapsed. The caller runs this off the critical
    path (a background thread at the lowest CPU priority).
    """
    blocks = size // HUGE_PAGE
    if blocks == 0:
        return 0
    view = map_aligned(fd, size, shared=False)
    done = 0
    for i in range(blocks):
        if stop():
            break
        try:
            madvise(view, MADV_COLLAPSE, i * HUGE_PAGE, HUGE_PAGE)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                break
            continue
        done += HUGE_PAGE
    del view  # unmapped by its finalizer
    return done


def allocate(
    writer: ctypes.Array[ctypes.c_char],
    fd: int,
    size: int,
    mode: str,
    threads: int,
    *,
    defer_collapse: bool = False,
) -> bool:
    """:func:`allocate_pack`'s first answer: whether the pack is (mostly) huge."""
    return allocate_pack(writer, fd, size, mode, threads, defer_collapse=defer_collapse)[0]


def allocate_pack(
    writer: ctypes.Array[ctypes.c_char],
    fd: int,
    size: int,
    mode: str,
    threads: int,
    *,
    defer_collapse: bool = False,
) -> tuple[bool, bool]:
    """Allocate every page of the pack behind ``writer`` now; whether it is (mostly) huge.

    Now, not on first touch: a shortage is then an error here, not SIGBUS or the OOM
    killer later (PITFALLS: /dev/shm and shmem fill up silently). How depends on
    ``mode``: through the advised writer (``advise``), by collapsing the empty pack
    first (``never``), or by ``posix_fallocate`` alone. ``OSError`` on a shortage.

    ``defer_collapse``: collapse before the fill only while it is cheap (at least
    :data:`CHEAP_COLLAPSE_RATE`: free 2 MiB pages to be had), leaving the rest for
    :func:`collapse_sealed` after the build. Returns ``(huge, complete)``: whether
    the pack is mostly huge, and whether nothing is left to collapse later.
    """
    if allocate_by_advice(mode):
        return advise_and_allocate(writer), True
    if not collapse_on_request(mode):
        os.posix_fallocate(fd, 0, size)
        return huge_by_itself(mode), True
    rate = CHEAP_COLLAPSE_RATE if defer_collapse else 0.0
    collapsed = collapse(fd, writer, threads, rate)
    os.posix_fallocate(fd, 0, size)  # what was not collapsed
    return collapsed * 2 >= size, collapsed >= size // HUGE_PAGE * HUGE_PAGE
