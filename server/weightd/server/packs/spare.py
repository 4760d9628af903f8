"""Spare pack memory: memfds allocated (and collapsed into huge pages) while the daemon
is idle, for the next build to fill instead of fresh memory. Off unless configured.

Why: filling fresh shared memory pays the kernel's allocation on the build's critical
path (reclaiming page cache, zeroing, one page-table entry per 4 KiB written, and
finding 2 MiB pages for huge ones), which can cost as much as reading, hashing and
copying the bytes together (``bench/pack_build.py``; docs/notes/2026-12-08-pack-build.md). A publish
builds packs of the same sizes as the version it replaces (same model, same layouts),
so after each build the daemon can prepare memory of those sizes in the background, at
the lowest CPU priority, and the next publish's build only copies and hashes.

What it costs: the spares are resident memory that holds nothing yet, up to
``local.spare_pack_bytes`` (0, the default: none). A host that publishes often (a
trainer's steps) and has the memory sets it to its layouts' pack bytes; a host that
loads once keeps the one copy. Spares are freed when the daemon stops.

Why it is safe: a spare is a memfd this process created (close-on-exec) and never
passed to anyone: no other process can have it mapped, so filling it is exactly
filling a fresh memfd. Spares are never made from packs: a published pack is sealed
(nobody can write it again, by design) and its descriptor went to clients, who may
still map it; recycling one would need both undone, so it is not done. A spare holds
only zeros until it is taken; a taken spare is truncated to the pack's size (allowed:
it is not sealed yet) and then filled, checked and sealed like any pack.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from weightd.common.hugemap import HUGE_PAGE, map_aligned

from .hugepages import allocate, shmem_mode

log = logging.getLogger("weightd.packs")

#: A spare's name in ``/proc/*/maps`` (a memfd's name cannot change once created).
SPARE_NAME: Final = "weightd:pack"


def capacity_for(size: int) -> int:
    """The spare size class of a pack of ``size`` bytes: whole 2 MiB blocks (pure)."""
    return max(HUGE_PAGE, -(-size // HUGE_PAGE) * HUGE_PAGE)


@dataclass(frozen=True, slots=True)
class Spare:
    fd: int
    capacity: int
    huge: bool


class SparePool:
    """Prepared memfds by size class, within ``budget_bytes`` (0: the pool is off)."""

    def __init__(self, budget_bytes: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._spares: list[Spare] = []
        self._preparing = 0  # bytes being prepared now (counted against the budget)
        self._closed = False
        self.taken_total = 0
        self.prepared_total = 0

    def configure(self, budget_bytes: int) -> None:
        """Set the budget; spares beyond it are freed."""
        with self._lock:
            self.budget_bytes = budget_bytes
            self._closed = False
            victims = []
            while self._spares and self._held() > budget_bytes:
                victims.append(self._spares.pop(0))
        for s in victims:
            os.close(s.fd)

    def _held(self) -> int:
        return sum(s.capacity for s in self._spares) + self._preparing

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.capacity for s in self._spares)

    def take(self, size: int) -> Spare | None:
        """A prepared spare for a pack of ``size`` bytes, truncated to it; None when none
        of its size class is ready (the build then allocates fresh memory)."""
        want = capacity_for(size)
        with self._lock:
            for i, s in enumerate(self._spares):
                if s.capacity == want:
                    spare = self._spares.pop(i)
                    break
            else:
                return None
        try:
            os.ftruncate(spare.fd, size)  # the tail's pages go; the rest stays allocated
        except OSError:
            os.close(spare.fd)
            return None
        with self._lock:
            self.taken_total += 1
        return spare

    def prepare(self, sizes: Sequence[int], threads: int = 1) -> int:
        """Prepare a spare for each of ``sizes`` that fits the budget (call off the
        critical path); how many were prepared. Never raises: memory that cannot be
        had now is simply not prepared."""
        done = 0
        for size in sizes:
            cap = capacity_for(size)
            with self._lock:
                if self._closed or self._held() + cap > self.budget_bytes:
                    continue
                self._preparing += cap
            spare = None
            try:
                spare = _make(cap, threads)
            except OSError as exc:
                log.info("spare pack memory of %d bytes not prepared: %s", cap, exc)
            finally:
                with self._lock:
                    self._preparing -= cap
                    keep = spare is not None and not self._closed
                    if keep and spare is not None:
                        self._spares.append(spare)
                        self.prepared_total += 1
                        done += 1
            if spare is not None and not keep:
                os.close(spare.fd)
        if done:
            log.info(
                "spare pack memory: %d prepared, %d bytes held of %d",
                done,
                self.held_bytes,
                self.budget_bytes,
            )
        return done

    def prepare_in_background(self, sizes: Sequence[int]) -> threading.Thread | None:
        """:meth:`prepare` on a thread of its own at the lowest CPU priority (None: off)."""
        if self.budget_bytes <= 0 or not sizes:
            return None

        def run() -> None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            self.prepare(sizes)

        thread = threading.Thread(target=run, name="weightd-pack-spare", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Free every spare; none is prepared after this (until :meth:`configure`)."""
        with self._lock:
            self._closed = True
            victims, self._spares = self._spares, []
        for s in victims:
            os.close(s.fd)


def _make(capacity: int, threads: int) -> Spare:
    """A memfd of ``capacity`` bytes, every page allocated now (huge where the mode gives
    or the daemon collapses them: empty, so collapsing copies nothing)."""
    mode = shmem_mode()
    fd = os.memfd_create(SPARE_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, capacity)
        writer = map_aligned(fd, capacity, shared=True)
        huge = allocate(writer, fd, capacity, mode, threads)
        del writer  # unmapped: a build maps its own writer
    except BaseException:
        os.close(fd)
        raise
    return Spare(fd, capacity, huge)


#: The daemon's pool (configured at assembly from ``local.spare_pack_bytes``).
POOL: Final = SparePool()
