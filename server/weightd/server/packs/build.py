"""Rank packs: one rank's slices laid out once in a sealed memfd, shared by every process.

Layout is pure (:func:`layout_pack`): the plan's slices in plan order, each at an
offset aligned to :data:`PACK_ALIGN` bytes (what CUDA allocations guarantee, and
more than any dtype needs), so a client builds each tensor as a view at its offset.

Base-weight packs are built a layout at a time in one pass over the checkpoint
(:mod:`.layoutbuild`). :func:`build_pack` here builds from anchored digests and a fill
function (adapter packs): the bytes are written straight into the memfd, and then:

1. the writer mapping is unmapped and the memfd sealed (``F_SEAL_SHRINK | GROW |
   WRITE | SEAL``): from here on nobody, the daemon included, can change or resize it,
   so a client mapping it can neither see it change nor take SIGBUS from a truncation;
2. the sealed bytes are re-hashed through a read-only mapping and compared with the
   anchors. Only a pack whose every slice matches is published.

Why copies and not windows onto one whole-model region: see docs/design/same-host.md ("Rank packs").
In short, a row-parallel slice is strided and must be copied anyway, a window onto
the shard file itself is exactly what a truncated or rewritten file must not be able
to disturb, and per-rank packs give each CUDA IPC export its own allocation.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import numpy as np

from weightd.common.digests import slice_digest
from weightd.common.hugemap import map_aligned

from ..base.cleanup import on_error
from ..base.errors import DataIntegrityError, PackMemoryExhausted
from ..plan.slices import TensorSlice
from ..trust.integrity import slice_hasher
from .hugepages import allocate, collapse_sealed, shmem_mode

log = logging.getLogger("weightd.packs")

#: Every tensor in a pack starts at a multiple of this many bytes.
PACK_ALIGN: Final = 256
#: Seals a published pack carries; clients refuse a memfd without the first three.
PACK_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_HASH_THREADS: Final = 4
#: Threads that anchor and fill a pack's slices (disjoint tensors, disjoint pack ranges).
_BUILD_THREADS: Final = 4


@dataclass(frozen=True, slots=True)
class PackEntry:
    """One slice in a pack: where it lies and what it must hash to."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    digest: str
    split_dim: int
    replicated: bool


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def layout_pack(slices: Sequence[TensorSlice], align: int = PACK_ALIGN) -> tuple[list[int], int]:
    """Offsets of ``slices`` packed in order, each aligned, and the pack's size. Pure.

    The size is at least ``align`` so that even an all-empty pack can be mapped.
    """
    if align <= 0 or align & (align - 1):
        raise ValueError(f"alignment {align} is not a power of two")
    offsets: list[int] = []
    end = 0
    for s in slices:
        start = _align(end, align)
        offsets.append(start)
        end = start + s.nbytes
    return offsets, max(_align(end, align), align)


class HostPack:
    """A published rank pack: its sealed memfd, a read-only mapping, and its table.

    The daemon keeps the descriptor (to pass to clients) and the mapping (to pin it
    and to copy it to a GPU). :meth:`close` drops both; clients that mapped the memfd
    keep their pages, which the kernel frees when the last mapping goes.
    """

    def __init__(
        self,
        fd: int,
        size: int,
        entries: tuple[PackEntry, ...],
        label: str,
        *,
        huge: bool = False,
        collapse_later: bool = False,
    ) -> None:
        self.fd = fd
        self.size = size
        self.entries = entries
        self.label = label
        #: Allocated where the kernel gives shmem huge pages (by itself, or advised);
        #: grants say so, and clients then populate their mapping by default.
        self.huge = huge
        self.mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        # numpy exports the mapping read-only and tells us its address (for pinning and
        # host-to-device copies); ctypes would insist on a writable buffer.
        self._array: np.ndarray | None = np.frombuffer(self.mapping, dtype=np.uint8)
        self._unpin: Callable[[], None] | None = None
        self._digests: dict[str, tuple[str, ...]] = {}
        self._digest_lock = threading.Lock()
        #: Filled into spare memory prepared while idle (``packs/spare.py``), for reports.
        self.from_spare = False
        #: Set once no huge-page upgrade is pending (at once when none was asked for).
        self.settled = threading.Event()
        if not collapse_later:
            self.settled.set()

    @property
    def closed(self) -> bool:
        return self._array is None

    def collapse_huge(self, fd: int) -> int:
        """Upgrade the built pack to huge pages now (see :func:`.hugepages.collapse_sealed`)
        through ``fd``, a duplicate of its descriptor taken while the pack was surely open,
        which this closes; bytes collapsed. Sets :attr:`huge` when most of it is, so later
        grants tell clients to populate. Never raises: a pack that stays in 4 KiB pages
        serves the same bytes.

        On a duplicate, so that :meth:`close` (eviction, shutdown) is never delayed nor
        confused by a collapse in flight (the collapse stops at its next block), and a
        descriptor number reused after the close is never touched.
        """
        done = 0
        try:
            done = collapse_sealed(fd, self.size, lambda: self.closed)
            if done * 2 >= self.size:
                self.huge = True  # before settled: whoever waited for it sees the claim
        except OSError as exc:
            log.debug("pack %s stays in 4 KiB pages: %s", self.label, exc)
        finally:
            os.close(fd)
            self.settled.set()
        return done

    def digests(self, kind: str) -> tuple[str, ...]:
        """Every entry's slice digest of ``kind`` (``sha256``, ``blake3``).

        The kind the pack was built with is its table; another is hashed once from the
        sealed bytes (which match the table: nobody can have changed them since) and
        kept, for clients that can check only that kind.
        """
        native = tuple(e.digest for e in self.entries)
        if all(d.startswith(f"{kind}:") for d in native):
            return native
        with self._digest_lock:
            found = self._digests.get(kind)
            if found is None:
                with memoryview(self.mapping) as view:
                    out = []
                    for e in self.entries:
                        h = slice_hasher(kind)
                        h.update(view[e.offset : e.offset + e.nbytes])
                        out.append(slice_digest(h, kind))
                found = self._digests[kind] = tuple(out)
        return found

    @property
    def pinned(self) -> bool:
        return self._unpin is not None

    def set_pinned(self, unpin: Callable[[], None]) -> None:
        """Record that the mapping is page-locked; ``unpin`` runs before it is unmapped."""
        self._unpin = unpin

    @property
    def address(self) -> int:
        if self._array is None:
            raise ValueError(f"pack {self.label} is closed")
        return int(self._array.ctypes.data)

    def close(self) -> None:
        if self._array is None:
            return
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self._array = None
        try:
            self.mapping.close()
        finally:
            os.close(self.fd)  # the descriptor goes even if the mapping is still in use


#: ``fill(slice, into)``: write exactly the slice's bytes into ``into``.
FillFn = Callable[[TensorSlice, memoryview], None]


def build_pack(
    slices: Sequence[TensorSlice],
    digests: Sequence[str],
    fill: FillFn,
    label: str,
    *,
    huge_mode: str | None = None,
) -> HostPack:
    """A sealed, re-verified pack of ``slices`` (each must hash to its digest), from ``fill``.

    Base weights fill from the shard store's descriptors; adapters from the verified
    in-memory copy of their weights file. Either way nothing is published before the
    sealed bytes were re-hashed against the digests. ``huge_mode``: the shmem THP mode
    to build for (None: this kernel's; see :mod:`.hugepages`).
    """
    mode = shmem_mode() if huge_mode is None else huge_mode
    offsets, size = layout_pack(slices)
    fd = os.memfd_create(label[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    with on_error(lambda: os.close(fd), f"the memfd of pack {label}"):
        try:
            os.ftruncate(fd, size)  # a file-size limit refuses this: EFBIG
        except OSError as exc:
            raise _exhausted(size, label, exc) from None
        huge = _fill(slices, fill, offsets, fd, size, label, mode=mode)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, PACK_SEALS)
        entries = tuple(
            PackEntry(s.name, s.dtype, s.shape, off, s.nbytes, d, s.split_dim, s.replicated)
            for s, off, d in zip(slices, offsets, digests, strict=True)
        )
        pack = HostPack(fd, size, entries, label, huge=huge)
    with on_error(pack.close, f"pack {label}"):
        _verify(pack, slices)
    return pack


def _exhausted(size: int, label: str, exc: OSError) -> PackMemoryExhausted:
    return PackMemoryExhausted(
        f"cannot allocate {size} bytes of shared memory for pack {label}: {exc.strerror}"
    )


def _fill(
    slices: Sequence[TensorSlice],
    fill: FillFn,
    offsets: list[int],
    fd: int,
    size: int,
    label: str,
    *,
    mode: str,
) -> bool:
    """Allocate and fill the pack through one writable mapping; whether it is huge.

    The writer is mapped at a 2 MiB boundary (``weightd.common.hugemap``): collapsing
    needs that, and writing a huge page through it then costs one fault, not 512. It
    is unmapped when its last view goes, at the latest when this returns (sealing
    would fail with EBUSY while it is mapped). A fill that fails (a shard changed
    under us: DATA_LOSS) surfaces as itself; the mapping then goes with its traceback.
    """
    try:
        writer = map_aligned(fd, size, shared=True)  # the one writer, unmapped before sealing
        huge = allocate(writer, fd, size, mode, min(_BUILD_THREADS, os.cpu_count() or 1))
    except OSError as exc:
        raise _exhausted(size, label, exc) from None
    # Slices fill disjoint ranges, on several threads: the reads release the GIL and the
    # first touch of each fresh shmem page (a page fault per 4 KiB) is then
    # paid on every core instead of one.
    with memoryview(writer).cast("B") as view:
        todo = [(s, off) for s, off in zip(slices, offsets, strict=True) if s.nbytes]

        def one(item: tuple[TensorSlice, int]) -> None:
            s, off = item
            with view[off : off + s.nbytes] as into:
                fill(s, into)

        workers = max(1, min(_BUILD_THREADS, os.cpu_count() or 1, len(todo)))
        with ThreadPoolExecutor(workers, thread_name_prefix="weightd-pack-fill") as pool:
            # list(): the first failure raises here, after every started fill has ended
            # (the executor's exit waits), so no thread still writes into the view.
            list(pool.map(one, todo))
    return huge


def _verify(pack: HostPack, slices: Sequence[TensorSlice]) -> None:
    """Hash every slice from the sealed memfd and compare with its anchored digest
    (each by its own kind: adapter packs carry the BLAKE3 digests taken at load)."""
    with memoryview(pack.mapping) as view:

        def digest(e: PackEntry) -> str:
            kind = e.digest.partition(":")[0]
            h = slice_hasher(kind)
            h.update(view[e.offset : e.offset + e.nbytes])
            return slice_digest(h, kind)

        workers = max(1, min(_HASH_THREADS, os.cpu_count() or 1, len(pack.entries)))
        with ThreadPoolExecutor(workers, thread_name_prefix="weightd-pack-hash") as pool:
            actual = list(pool.map(digest, pack.entries))
    for e, s, got in zip(pack.entries, slices, actual, strict=True):
        if got != e.digest:
            raise DataIntegrityError(
                f"tensor {e.name!r} in shard {s.shard}: bytes copied into pack {pack.label} hash "
                f"to {got}, the verified slice to {e.digest}"
            )
