"""Building every rank pack of a layout in one pass over the checkpoint, on every core.

Why one pass: the build this replaces read each tensor twice (once to anchor every
peer's SHA-256 against the verified BLAKE3, once more to fill the pack) and hashed
the sealed pack a third time with SHA-256, one rank at a time. A layout's ranks
together hold every tensor (each once, or a replicated one once per rank), so reading
each tensor once and cutting it into all of them at once is the least I/O there is;
what is left per byte is one read, one BLAKE3 of the tensor (the proof) and one BLAKE3
of each rank's slice (the digest a client checks). Measured: docs/notes (vLLM load).

The proof, per tensor, unchanged in strength:

* *contiguous cuts* (the whole tensor, blocks of dim 0, a padded vocabulary) are read
  straight into the packs' own memory; the BLAKE3 of those pack bytes, in file order,
  must equal the verified tensor digest. The bytes proven are the bytes handed out:
  there is no later copy to go wrong, and no window between a proof and a second read
  of a file that may have changed meanwhile (the old build's reason to re-hash);
* *strided cuts* (row-parallel, fused blocks) are read in row blocks into a private
  scratch buffer, hashed as they are read (the tensor's BLAKE3 over exactly the bytes
  then copied out), and each rank's part copied from there;
* a copy of a slice another rank already holds (replicated tensors) must hash to the
  same digest as the one it was copied from.

Each entry's digest is the BLAKE3 of the slice *as it lies in the pack*, computed
after the fill; the memfd is then sealed (nobody, the daemon included, can change it
any more), so what a client maps hashes to its table. BLAKE3 slice digests are what
gRPC clients with ``blake3`` already check; a client that can check only SHA-256 gets
SHA-256 digests computed from the sealed pack (:meth:`.build.HostPack.digests`).

Threads: tensors, largest first, on ``os.cpu_count()`` threads; ``preadv``, blake3
and numpy's copies release the GIL, and filling fresh shared memory (one page fault
per page not yet mapped) is paid on every core.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import blake3
import numpy as np

from weightd.common.digests import BLAKE3, format_digest
from weightd.common.hugemap import map_aligned

from ..base.cleanup import on_error, release_frames
from ..base.errors import DataIntegrityError
from ..checkpoint.description import TensorInfo
from ..plan.planner import RankPlan
from ..plan.slices import TensorSlice
from ..registry.models import LoadedModel
from ..store.runs import RunPattern
from ..store.shards import ShardStore
from .build import PACK_SEALS, HostPack, PackEntry, _exhausted, layout_pack
from .hugepages import allocate_pack, collapse_on_request, shmem_mode
from .spare import POOL, SparePool

#: Scratch per thread for strided cuts: rows are read this many bytes at a time.
SCRATCH_BYTES: Final = 16 << 20


@dataclass(frozen=True, slots=True)
class Target:
    """One rank's slice of a tensor and where it goes: pack ``pack``, entry ``entry``."""

    pack: int
    entry: int
    slice: TensorSlice


def _contiguous(p: RunPattern) -> tuple[int, int] | None:
    """``(file offset, length)`` when the pattern is one run of bytes, else None (pure)."""
    runs = [(off, n) for off, n in p.segments if n]
    if p.count == 1 and len(runs) <= 1:
        off, n = runs[0] if runs else (0, 0)
        return p.base + off, n
    return None


def tiling(tensor: TensorInfo, slices: Sequence[TensorSlice]) -> list[int] | None:
    """Indexes of ``slices`` whose runs tile the tensor in file order, or None (pure).

    Where every slice is one contiguous run and the distinct runs cover the tensor
    exactly, end to end, the tensor can be read straight into the packs: the returned
    slices (one per distinct run, in file order) receive the read; the others repeat
    one of them (replicated tensors) and are copied from it.
    """
    runs: dict[tuple[int, int], int] = {}
    for i, s in enumerate(slices):
        run = _contiguous(s.pattern)
        if run is None:
            return None
        runs.setdefault(run, i)
    pos = tensor.offset
    order = []
    for (start, length), i in sorted(runs.items()):
        if start != pos or length <= 0:
            return None
        order.append(i)
        pos += length
    return order if pos == tensor.offset + tensor.nbytes else None


def _hex(data: memoryview) -> str:
    return format_digest(BLAKE3, blake3.blake3(data).hexdigest())


class _Fill:
    """Fills the packs' writer views tensor by tensor; one instance per build."""

    def __init__(self, store: ShardStore, digests: dict[str, str], views: list[memoryview]) -> None:
        self.store = store
        self.verified = digests
        self.views = views
        self._local = threading.local()
        self._maps: list[tuple[mmap.mmap, memoryview]] = []
        self._lock = threading.Lock()

    def scratch(self, size: int = SCRATCH_BYTES) -> memoryview:
        """This thread's scratch buffer (``size`` bytes where rows are longer).

        Anonymous mappings, not ``bytearray``: freed, a 16 MiB heap block raises
        glibc's mmap threshold and the next build's scratch stays in the heap for
        good (a daemon building packs again and again grew by tens of MiB).
        """
        buf: memoryview | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            m = mmap.mmap(-1, max(size, SCRATCH_BYTES))
            buf = memoryview(m)
            with self._lock:
                self._maps.append((m, buf))
            self._local.buf = buf
        return buf

    def close(self) -> None:
        """Unmap every scratch buffer (after the last fill ended)."""
        with self._lock:
            maps, self._maps = self._maps, []
        for m, view in maps:
            try:
                view.release()
                m.close()
            except BufferError:  # still viewed (a failure's frames): freed with them
                continue

    def region(self, t: Target, offset: int) -> memoryview:
        return self.views[t.pack][offset : offset + t.slice.nbytes]

    def tensor(
        self, tensor: TensorInfo, targets: Sequence[Target], offsets: Sequence[int]
    ) -> list[str]:
        """Fill every target's region from one read of ``tensor``; their digests."""
        slices = [t.slice for t in targets]
        regions = [self.region(t, off) for t, off in zip(targets, offsets, strict=True)]
        order = tiling(tensor, slices)
        if order is not None:
            whole = blake3.blake3()
            for i in order:
                self.store.read_pattern_into(tensor.shard, slices[i].pattern, regions[i])
                whole.update(regions[i])
            primary = {_contiguous(slices[i].pattern): i for i in order}
        else:
            whole = self._strided(tensor, slices, regions)
            primary = {}
        self.store.check(tensor.shard)
        actual = format_digest(BLAKE3, whole.hexdigest())
        if actual != self.verified[tensor.name]:
            raise DataIntegrityError(
                f"tensor {tensor.name!r} in shard {tensor.shard}: bytes read into the packs "
                f"hash to {actual}, the verified digest is {self.verified[tensor.name]}"
            )
        digests = []
        for i, (s, region) in enumerate(zip(slices, regions, strict=True)):
            run = _contiguous(s.pattern)
            source = primary.get(run) if run is not None else None
            if source is not None and source != i:
                region[:] = regions[source]  # a replicated slice: copied, hashed below
            if source == i and len(primary) == 1:
                digests.append(actual)  # the whole tensor: its digest is the proof's
            else:
                digests.append(_hex(region))
        for i, s in enumerate(slices):
            run = _contiguous(s.pattern)
            source = primary.get(run) if run is not None else None
            if source is not None and digests[i] != digests[source]:
                raise DataIntegrityError(
                    f"tensor {tensor.name!r}: a copy of its slice hashes to {digests[i]}, "
                    f"the slice it was copied from to {digests[source]}"
                )
        return digests

    def _strided(
        self, tensor: TensorInfo, slices: Sequence[TensorSlice], regions: Sequence[memoryview]
    ) -> blake3.blake3:
        """Read ``tensor`` in row blocks through scratch, copying each slice's part out."""
        strided = [s.pattern for s in slices if s.pattern.count > 1]
        stride = strided[0].stride if strided else SCRATCH_BYTES
        for p in strided:
            if (
                p.stride != stride
                or tensor.nbytes % stride
                or (p.base - tensor.offset) % stride
                or p.base < tensor.offset
                or p.base - tensor.offset + p.count * p.stride > tensor.nbytes
            ):
                raise DataIntegrityError(
                    f"tensor {tensor.name!r}: rank patterns disagree on row layout"
                )
        scratch = self.scratch(stride)  # rows longer than the scratch: one row at a time
        step = max(1, len(scratch) // stride) * stride if strided else len(scratch)
        whole = blake3.blake3()
        grids = [
            np.frombuffer(r, dtype=np.uint8).reshape(s.pattern.count, s.pattern.row_bytes)
            if s.pattern.count > 1 and s.nbytes
            else None
            for s, r in zip(slices, regions, strict=True)
        ]
        for lo in range(0, tensor.nbytes, step):
            n = min(step, tensor.nbytes - lo)
            block = scratch[:n]
            self.store.read_into(tensor.shard, tensor.offset + lo, block)
            whole.update(block)
            start = tensor.offset + lo
            for s, region, grid in zip(slices, regions, grids, strict=True):
                p = s.pattern
                if grid is None:
                    _copy_runs(p, block, start, region)
                    continue
                first = (p.base - tensor.offset) // stride
                a, b = max(lo // stride, first), min((lo + n) // stride, first + p.count)
                if a >= b:
                    continue
                rows = np.frombuffer(block, dtype=np.uint8).reshape(n // stride, stride)
                out = 0
                for off, length in p.segments:
                    grid[a - first : b - first, out : out + length] = rows[
                        a - lo // stride : b - lo // stride, off : off + length
                    ]
                    out += length
        return whole


def _copy_runs(p: RunPattern, block: memoryview, start: int, region: memoryview) -> None:
    """Copy the part of one-row pattern ``p`` that lies in ``block`` (file offset ``start``)."""
    out = 0
    for off, length in p.segments:
        a, b = max(start, p.base + off), min(start + len(block), p.base + off + length)
        if a < b:
            dst = out + a - (p.base + off)
            region[dst : dst + b - a] = block[a - start : b - start]
        out += length


def build_rank_packs(
    store: ShardStore,
    tensors: Mapping[str, TensorInfo],
    digests: dict[str, str],
    plans: Sequence[RankPlan],
    labels: Sequence[str],
    *,
    threads: int | None = None,
    huge_mode: str | None = None,
    collapse_later: bool = True,
    spares: SparePool | None = POOL,
) -> list[HostPack]:
    """Sealed packs for ``plans`` (the ranks of one layout, say), from one read per tensor.

    ``digests``: the verified BLAKE3 of every tensor. Raises DataIntegrityError (a
    shard changed since it was verified) or PackMemoryExhausted; nothing half-built is
    returned, every memfd of a failed build is closed.

    ``collapse_later``: where the daemon collapses packs into huge pages itself (shmem
    THP ``never``), collapse before the fill only while free 2 MiB pages are cheap to
    find, and the rest after the packs are sealed, on a background thread at the
    lowest CPU priority (:func:`collapse_in_background`): on a host whose memory is
    page cache, finding 2 MiB pages was most of a build's time. Each pack's
    ``settled`` event says when its upgrade ended.

    ``spares``: memory prepared while idle (:mod:`.spare`; off unless configured) is
    filled where a spare of a pack's size class is ready, and spares of these packs'
    sizes are prepared after the build, in the background, for the next version.
    """
    mode = shmem_mode() if huge_mode is None else huge_mode
    later = collapse_later and collapse_on_request(mode)
    workers = max(1, threads or os.cpu_count() or 1)
    shapes = [layout_pack(p.slices) for p in plans]
    fds: list[int] = []
    writers: list[ctypes.Array[ctypes.c_char]] = []

    def close_all() -> None:
        writers.clear()
        for fd in fds:
            os.close(fd)

    with on_error(close_all, f"packs {', '.join(labels)}"):
        huge: list[bool] = []
        whole: set[int] = set()  # packs with nothing left to collapse after the build
        spared: set[int] = set()  # packs filled into spare memory
        for (_, size), label in zip(shapes, labels, strict=True):
            spare = spares.take(size) if spares is not None else None
            if spare is not None:  # prepared while idle: allocated (and huge) already
                fds.append(spare.fd)
                try:
                    writers.append(map_aligned(spare.fd, size, shared=True))
                except OSError as exc:
                    raise _exhausted(size, label, exc) from None
                huge.append(spare.huge)
                whole.add(len(fds) - 1)  # collapsed (or not) while idle: left as it is
                spared.add(len(fds) - 1)
                continue
            fd = os.memfd_create(label[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            fds.append(fd)
            try:
                os.ftruncate(fd, size)
                writers.append(map_aligned(fd, size, shared=True))
                is_huge, complete = allocate_pack(
                    writers[-1], fd, size, mode, workers, defer_collapse=later
                )
                huge.append(is_huge)
                if complete:
                    whole.add(len(fds) - 1)
            except OSError as exc:
                raise _exhausted(size, label, exc) from None
        jobs: dict[str, list[tuple[Target, int]]] = {}
        for k, (plan, (offsets, _)) in enumerate(zip(plans, shapes, strict=True)):
            for j, (s, off) in enumerate(zip(plan.slices, offsets, strict=True)):
                if s.nbytes:
                    jobs.setdefault(s.name, []).append((Target(k, j, s), off))
        entry_digests: list[list[str]] = [
            [_hex(memoryview(b"")) for _ in plan.slices] for plan in plans
        ]
        views = [memoryview(w).cast("B") for w in writers]
        fill = _Fill(store, digests, views)
        try:

            def one(name: str) -> None:
                targets = jobs[name]
                got = fill.tensor(
                    tensors[name], [t for t, _ in targets], [off for _, off in targets]
                )
                for (t, _), d in zip(targets, got, strict=True):
                    entry_digests[t.pack][t.entry] = d

            order = sorted(jobs, key=lambda n: -tensors[n].nbytes)
            with ThreadPoolExecutor(
                min(workers, max(1, len(order))), thread_name_prefix="weightd-pack-build"
            ) as pool:
                list(pool.map(one, order))  # the first failure raises after every fill ended
        except BaseException as exc:
            release_frames(exc)  # its frames' views of the scratch and the packs go now
            raise
        finally:
            fill.close()
            for v in views:
                v.release()
            views.clear()
        writers.clear()  # unmapped: sealing fails with EBUSY while a writable mapping exists
        packs: list[HostPack] = []

        def close_packs() -> None:
            for p in packs:
                p.close()

        with on_error(close_packs, "sealed packs"):
            for plan, (offsets, size), label, is_huge, ds in zip(
                plans, shapes, labels, huge, entry_digests, strict=True
            ):
                fd = fds[0]
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, PACK_SEALS)
                entries = tuple(
                    PackEntry(s.name, s.dtype, s.shape, off, s.nbytes, d, s.split_dim, s.replicated)
                    for s, off, d in zip(plan.slices, offsets, ds, strict=True)
                )
                upgrade = later and len(packs) not in whole
                pack = HostPack(fd, size, entries, label, huge=is_huge, collapse_later=upgrade)
                pack.from_spare = len(packs) in spared
                packs.append(pack)
                fds.pop(0)  # the pack owns it now
    pending = [p for p in packs if not p.settled.is_set()]
    if pending:
        collapse_in_background(pending)
    if spares is not None:  # the next version's packs have these sizes: prepare them now
        spares.prepare_in_background([size for _, size in shapes])
    return packs


def _collapse_quietly(work: Sequence[tuple[HostPack, int]]) -> None:
    """The background upgrade of :func:`collapse_in_background` (its thread's body)."""
    # The lowest priority this thread can have: engines starting, fetches and the
    # next build come first; on an idle host it still runs at full speed.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    for pack, fd in work:
        pack.collapse_huge(fd)  # never raises; closes fd, sets pack.settled


def collapse_in_background(packs: Sequence[HostPack]) -> threading.Thread | None:
    """Upgrade ``packs`` (built, sealed, served already) to huge pages on a thread of its
    own, one block at a time; a pack freed meanwhile is left at its next block.

    Each pack's descriptor is duplicated here, while the caller surely holds the pack
    open (a pack closed before the thread reaches it keeps its memory only until then).
    """
    work: list[tuple[HostPack, int]] = []
    for pack in packs:
        try:
            work.append((pack, os.dup(pack.fd)))
        except OSError:  # out of descriptors: that pack stays in 4 KiB pages
            pack.settled.set()
    if not work:
        return None
    try:
        thread = threading.Thread(
            target=_collapse_quietly, args=(work,), name="weightd-pack-huge", daemon=True
        )
        thread.start()
    except BaseException:
        for pack, fd in work:
            os.close(fd)
            pack.settled.set()
        raise
    return thread


def build_host_pack(
    model: LoadedModel, plan: RankPlan, label: str, *, huge_mode: str | None = None
) -> HostPack:
    """The pack of one rank (a layout nobody declared, asked for by a worker)."""
    (pack,) = build_layout_packs(model, [plan], [label], huge_mode=huge_mode)
    return pack


def build_layout_packs(
    model: LoadedModel,
    plans: Sequence[RankPlan],
    labels: Sequence[str],
    *,
    threads: int | None = None,
    huge_mode: str | None = None,
) -> list[HostPack]:
    """:func:`build_rank_packs` of ``model``'s verified tensors."""
    return build_rank_packs(
        model.store,
        model.checkpoint.tensors,
        model.tensor_digests,
        plans,
        labels,
        threads=threads,
        huge_mode=huge_mode,
    )
