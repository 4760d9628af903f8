"""Digests: every tensor's at load, and every served slice's, anchored to the tensor's.

At load each tensor is hashed whole with BLAKE3 (cryptographic, several times faster
per core than SHA-256, GIL released, shards hashed in parallel). A slice's SHA-256 (what clients
check) is never computed from bytes that were not first proven to be the verified
tensor: the first time any rank of a layout asks for a tensor, the whole tensor is
read once, its BLAKE3 compared with the verified digest, and the SHA-256 of every
rank's slice computed from those same bytes. Later fetches re-hash the bytes they
send and compare with that anchor, so a file changed after verification is caught
on the server (DATA_LOSS) and, independently, by the client.

A client may ask for BLAKE3 slice digests instead (``FetchRequest.slice_digest``):
they are anchored the same way, per kind (``kind`` below), from the same proof.

The work a client can make the daemon do is bounded by what it asks to receive: each
``(tp_size, vocab_pad)`` pair can be a cut of its own, so anchoring every new cut by
reading the whole tensor would let a client cycling through paddings make the daemon
hash a 64 MiB vocabulary tensor per one-byte Fetch. A tensor larger than
:data:`WHOLE_ANCHOR_BYTES` is therefore proven once, whole, into per-block BLAKE3
digests (:data:`ANCHOR_BLOCK_BYTES` each; 32 bytes per MiB kept), and from then on
each cut anchors only the slice asked for, reading and hashing just the blocks its
runs touch, each checked against its block digest: a cut costs the slice plus at
most two blocks per run, not the tensor. :attr:`SliceAnchors.hashed_bytes` counts
the bytes read and hashed for anchors, so the bound is tested by counting work.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from concurrent.futures import Future
from typing import Final

import blake3
import numpy as np

from weightd.common.digests import (
    BLAKE3,
    SLICE_DIGEST_ALGORITHM,
    SLICE_DIGEST_KINDS,
    Hasher,
    format_digest,
    slice_digest,
)

from ..base.cleanup import release_frames
from ..base.errors import DataIntegrityError
from ..checkpoint.description import Checkpoint, TensorInfo
from ..store.runs import RunPattern
from ..store.shards import ShardStore
from .hashing import ShardJob, TensorRange, hash_shards

TENSOR_DIGEST_ALGORITHM: Final = "blake3"
BLOCK_BYTES: Final = 16 << 20


def hash_checkpoint(
    ckpt: Checkpoint,
    store: ShardStore,
    threads: int | None = None,
    *,
    only: Collection[str] | None = None,
    check: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """BLAKE3 of every tensor of an open checkpoint (no file SHA-256).

    The same single pass per shard that verification uses (:mod:`.hashing`), for
    callers that hold a checkpoint and its store rather than a directory. ``only``
    limits it to those shards; ``check(shard)`` runs after each shard's pass
    (default: the store's serving check).
    """
    after = check or store.check
    ranges: dict[str, list[TensorRange]] = {s: [] for s in ckpt.shards if only is None or s in only}
    for t in ckpt.tensors.values():
        if t.shard in ranges:
            ranges[t.shard].append(TensorRange(t.name, t.offset, t.nbytes))
    jobs = [
        ShardJob(
            shard,
            store.shard(shard).path,
            store.shard(shard).fd,
            store.shard(shard).identity.size,
            tuple(sorted(rs, key=lambda r: r.offset)),
            sha256=False,
            check=functools.partial(after, shard),
        )
        for shard, rs in ranges.items()
    ]
    out: dict[str, str] = {}
    for digests in hash_shards(jobs, threads).values():
        out.update(digests.tensors)
    return out


def slice_hasher(kind: str) -> Hasher:
    """A fresh hasher of slice digest ``kind`` (one of ``SLICE_DIGEST_KINDS``)."""
    if kind == BLAKE3:
        return blake3.blake3()
    if kind == SLICE_DIGEST_ALGORITHM:
        return hashlib.sha256()
    raise ValueError(f"slice digest kind {kind!r} is not one of {SLICE_DIGEST_KINDS}")


def anchor_slices(
    store: ShardStore,
    tensor: TensorInfo,
    verified: str,
    patterns: Sequence[RunPattern],
    kind: str = SLICE_DIGEST_ALGORITHM,
) -> list[str]:
    """Each pattern's ``kind`` digest, from one read of the tensor proven to be ``verified``."""
    hashers = [slice_hasher(kind) for _ in patterns]
    whole = blake3.blake3()
    buf = bytearray(min(BLOCK_BYTES, max(tensor.nbytes, 1)))
    view = memoryview(buf)
    if all(p.count == 1 for p in patterns):
        pos = 0
        while pos < tensor.nbytes:
            n = min(len(buf), tensor.nbytes - pos)
            store.read_into(tensor.shard, tensor.offset + pos, view[:n])
            whole.update(view[:n])
            lo, hi = tensor.offset + pos, tensor.offset + pos + n
            for p, h in zip(patterns, hashers, strict=True):
                for off, length in p.segments:
                    a, b = max(lo, p.base + off), min(hi, p.base + off + length)
                    if a < b:
                        h.update(view[a - lo : b - lo])
            pos += n
    else:
        # Strided patterns (row-parallel cuts, cuts inside stacked experts) share one row
        # stride and start on a row of the tensor seen as a grid of such rows; they may
        # start on different rows (stacked experts of different ep ranks). Contiguous
        # patterns in the same partition are matched by offset, as above.
        stride = next(p.stride for p in patterns if p.count > 1)
        strided = [p.count > 1 for p in patterns]
        if tensor.nbytes % stride or any(
            s
            and (
                p.stride != stride
                or (p.base - tensor.offset) % stride
                or p.base < tensor.offset
                or p.base - tensor.offset + p.count * stride > tensor.nbytes
            )
            for p, s in zip(patterns, strided, strict=True)
        ):
            raise DataIntegrityError(
                f"tensor {tensor.name!r}: rank patterns disagree on row layout"
            )
        rows_total = tensor.nbytes // stride
        rows_per_block = max(1, len(buf) // stride)
        if rows_per_block * stride > len(buf):
            buf = bytearray(stride)
            view = memoryview(buf)
        for row in range(0, rows_total, rows_per_block):
            rows = min(rows_per_block, rows_total - row)
            n = rows * stride
            lo = tensor.offset + row * stride
            store.read_into(tensor.shard, lo, view[:n])
            whole.update(view[:n])
            grid = np.frombuffer(buf, dtype=np.uint8, count=n).reshape(rows, stride)
            for p, h, s in zip(patterns, hashers, strided, strict=True):
                if not s:
                    for off, length in p.segments:
                        a, b = max(lo, p.base + off), min(lo + n, p.base + off + length)
                        if a < b:
                            h.update(view[a - lo : b - lo])
                    continue
                first = (p.base - tensor.offset) // stride
                a, b = max(row, first), min(row + rows, first + p.count)
                if a >= b:
                    continue
                parts = [grid[a - row : b - row, off : off + length] for off, length in p.segments]
                block = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
                h.update(np.ascontiguousarray(block).data)
    store.check(tensor.shard)
    actual = format_digest(TENSOR_DIGEST_ALGORITHM, whole.hexdigest())
    if actual != verified:
        raise DataIntegrityError(
            f"tensor {tensor.name!r} in shard {tensor.shard}: bytes on disk hash to {actual}, "
            f"verified digest is {verified}"
        )
    return [slice_digest(h, kind) for h in hashers]


#: Anchored cuts a model keeps (each a list of its peers' digests: ~100 bytes a rank).
MAX_ANCHOR_ENTRIES = 4096
#: Tensors up to this size are anchored whole, every peer from one read (cheap).
WHOLE_ANCHOR_BYTES = 4 << 20
#: Bytes per block digest of a larger tensor.
ANCHOR_BLOCK_BYTES = 1 << 20
#: Runs a slice may have to be anchored from blocks (a run is a Python step); a slice
#: of more, tiny runs is anchored whole with its peers (numpy, one read).
MAX_BLOCK_RUNS = 1 << 16


def block_digests(
    store: ShardStore, tensor: TensorInfo, verified: str, block: int
) -> tuple[bytes, ...]:
    """BLAKE3 of each ``block``-byte block of ``tensor``, from one read proven to be the
    ``verified`` whole-tensor digest."""
    whole = blake3.blake3()
    out = []
    buf = bytearray(min(block, max(tensor.nbytes, 1)))
    view = memoryview(buf)
    for pos in range(0, tensor.nbytes, block):
        n = min(block, tensor.nbytes - pos)
        store.read_into(tensor.shard, tensor.offset + pos, view[:n])
        whole.update(view[:n])
        out.append(blake3.blake3(view[:n]).digest())
    store.check(tensor.shard)
    actual = format_digest(TENSOR_DIGEST_ALGORITHM, whole.hexdigest())
    if actual != verified:
        raise DataIntegrityError(
            f"tensor {tensor.name!r} in shard {tensor.shard}: bytes on disk hash to {actual}, "
            f"verified digest is {verified}"
        )
    return tuple(out)


def anchor_from_blocks(
    store: ShardStore,
    tensor: TensorInfo,
    blocks: Sequence[bytes],
    block: int,
    pattern: RunPattern,
    kind: str = SLICE_DIGEST_ALGORITHM,
) -> tuple[str, int]:
    """``pattern``'s ``kind`` digest, reading only the blocks its runs touch, each proven
    against its block digest. Returns the digest and the bytes read and hashed."""
    h = slice_hasher(kind)
    buf = bytearray(min(block, max(tensor.nbytes, 1)))
    view = memoryview(buf)
    current, size, work = -1, 0, 0
    for off, length in pattern.ranges():
        rel, n = off - tensor.offset, length
        if rel < 0 or rel + n > tensor.nbytes:
            raise DataIntegrityError(f"tensor {tensor.name!r}: a slice run outside the tensor")
        while n > 0:
            index = rel // block
            if index != current:
                size = min(block, tensor.nbytes - index * block)
                store.read_into(tensor.shard, tensor.offset + index * block, view[:size])
                work += size
                if blake3.blake3(view[:size]).digest() != blocks[index]:
                    raise DataIntegrityError(
                        f"tensor {tensor.name!r} in shard {tensor.shard}: bytes "
                        f"[{index * block}, {index * block + size}) on disk differ from the "
                        "verified ones"
                    )
                current = index
            a = rel - index * block
            take = min(n, size - a)
            h.update(view[a : a + take])
            rel += take
            n -= take
    store.check(tensor.shard)
    return slice_digest(h, kind), work


class SliceAnchors:
    """Cache of anchored slice digests, keyed by (tensor, partition, kind); asks coalesce.

    A partition (``slices.Partition.key``) identifies one cut of a tensor and all its
    peer slices, whatever pipeline stage or expert rank asks for them.

    Bounded (least recently used out first): layouts are client-chosen, and each
    ``(tp_size, vocab_pad)`` pair can be a cut of its own, so a client cycling through
    them must not grow the daemon's memory without end. An evicted cut is anchored
    again when asked for (one read of its tensor, what a Fetch of it costs anyway).
    """

    def __init__(
        self,
        store: ShardStore,
        tensor_digests: dict[str, str],
        max_entries: int = MAX_ANCHOR_ENTRIES,
    ) -> None:
        self._store = store
        self._digests = tensor_digests
        self._lock = threading.Lock()
        self._max = max_entries
        self._cache: OrderedDict[tuple[Hashable, ...], Future[list[str]]] = OrderedDict()
        #: Per-block digests of the large tensors proven so far (see the module docstring).
        self._blocks: dict[str, Future[tuple[bytes, ...]]] = {}
        #: Bytes read and hashed to anchor slices (the work clients made the daemon do).
        self.hashed_bytes = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def _count(self, n: int) -> None:
        with self._lock:
            self.hashed_bytes += n

    def _tensor_blocks(self, tensor: TensorInfo) -> tuple[bytes, ...]:
        """``tensor``'s block digests, proven once (concurrent askers share the read)."""
        with self._lock:
            future = self._blocks.get(tensor.name)
            owner = future is None
            if future is None:
                future = self._blocks[tensor.name] = Future()
        if owner:
            try:
                blocks = block_digests(
                    self._store, tensor, self._digests[tensor.name], ANCHOR_BLOCK_BYTES
                )
            except BaseException as exc:
                release_frames(exc)
                with self._lock:
                    self._blocks.pop(tensor.name, None)
                future.set_exception(exc)
                raise
            self._count(tensor.nbytes)
            future.set_result(blocks)
        return future.result()

    def _coalesced(self, key: tuple[Hashable, ...], compute: Callable[[], list[str]]) -> list[str]:
        with self._lock:
            future = self._cache.get(key)
            owner = future is None
            if future is None:
                future = Future()
                self._cache[key] = future
                while len(self._cache) > self._max:  # waiters keep their own futures
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                future.set_result(compute())
            except BaseException as exc:
                release_frames(exc)  # waiters share the error; its frames' buffers go now
                with self._lock:
                    if self._cache.get(key) is future:  # not evicted meanwhile
                        del self._cache[key]
                future.set_exception(exc)
                raise
        return future.result()

    def get(
        self,
        tensor: TensorInfo,
        partition: Hashable,
        index: int,
        patterns_for_all_ranks: Callable[[], Sequence[RunPattern]],
        kind: str = SLICE_DIGEST_ALGORITHM,
    ) -> str:
        """The anchored ``kind`` digest of peer ``index`` of ``partition``'s cut of ``tensor``.

        A small tensor: every peer anchored from one read of it. A large one: only peer
        ``index``, from the blocks its runs touch (the module docstring says why).
        """
        if tensor.nbytes > WHOLE_ANCHOR_BYTES:
            patterns = patterns_for_all_ranks()
            pattern = patterns[index]
            if pattern.count * len(pattern.segments) <= MAX_BLOCK_RUNS:

                def one() -> list[str]:
                    blocks = self._tensor_blocks(tensor)
                    digest, work = anchor_from_blocks(
                        self._store, tensor, blocks, ANCHOR_BLOCK_BYTES, pattern, kind
                    )
                    self._count(work)
                    return [digest]

                return self._coalesced((tensor.name, partition, kind, index), one)[0]

        def every() -> list[str]:
            self._count(tensor.nbytes)
            return anchor_slices(
                self._store, tensor, self._digests[tensor.name], patterns_for_all_ranks(), kind
            )

        return self._coalesced((tensor.name, partition, kind), every)[index]
