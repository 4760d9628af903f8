"""One pass over each shard: the file's SHA-256 and every tensor's BLAKE3 together.

Why one pass: a cold checkpoint costs a disk read per byte; reading it twice (once
per digest) would double the start-up time. Each shard is read once, in blocks, and
each block is handed to two hashing lanes — one feeding the file's SHA-256 (and, when
asked, git's SHA-1), one feeding the BLAKE3 of the tensor(s) the block covers — while
the next block is being read. ``preadv``, ``hashlib`` (for buffers over 2 KiB) and
``blake3`` (for long inputs) all release the GIL, so reading and both hashes really
run at once, and several shards are hashed in parallel.

The file SHA-256 is computed only when something will compare it (a manifest, cache
blob names, ``weightd verify``): it costs about twice the per-tensor BLAKE3, which is
all that serving itself needs.

Memory stays bounded: ``depth`` blocks per shard in flight, ``threads`` shards at
once. A shard is fstat-checked after its pass: a file that changed while it was
hashed fails here rather than having its digests trusted.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

import blake3

from weightd.common.digests import format_digest

from ..base.errors import DataIntegrityError

BLOCK_BYTES: Final = 4 << 20  # big enough to amortize calls, small enough to stay in cache
DEPTH: Final = 4  # blocks in flight per shard


@dataclass(frozen=True, slots=True)
class TensorRange:
    name: str
    offset: int  # absolute file offset
    nbytes: int


@dataclass(frozen=True)
class ShardJob:
    """One shard to hash: an open descriptor, its size, and the tensors it holds."""

    name: str
    path: str
    fd: int
    size: int
    tensors: tuple[TensorRange, ...]
    git_sha1: bool = False  # also git's blob SHA-1 (a Hugging Face cache names some blobs so)
    sha256: bool = True  # the file's SHA-256 (off when nothing will compare it)
    #: Called after the pass, to prove the file did not change while it was read.
    check: Callable[[], None] | None = None


@dataclass(frozen=True)
class ShardDigests:
    size: int
    sha256: str  # hex; "" when not computed
    tensors: dict[str, str]  # name -> "blake3:<hex>"
    git_sha1: str = ""  # hex, when asked for


class _TensorLane:
    """Feeds each block to the BLAKE3 of every tensor it overlaps, in file order."""

    def __init__(self, tensors: Sequence[TensorRange]) -> None:
        # Zero-byte tensors overlap no block (one may sit at the very end of the file):
        # digest them now and keep only the others in the queue.
        empty = format_digest("blake3", blake3.blake3().hexdigest())
        self.digests: dict[str, str] = {t.name: empty for t in tensors if t.nbytes == 0}
        self._tensors = sorted((t for t in tensors if t.nbytes), key=lambda t: t.offset)
        self._next = 0
        self._active: list[tuple[TensorRange, blake3.blake3]] = []

    def feed(self, offset: int, block: memoryview) -> None:
        end = offset + len(block)
        while self._next < len(self._tensors) and self._tensors[self._next].offset < end:
            t = self._tensors[self._next]
            self._next += 1
            self._active.append((t, blake3.blake3()))
        still: list[tuple[TensorRange, blake3.blake3]] = []
        for t, h in self._active:
            lo, hi = max(offset, t.offset), min(end, t.offset + t.nbytes)
            if lo < hi:
                h.update(block[lo - offset : hi - offset])
            if t.offset + t.nbytes <= end:
                self.digests[t.name] = format_digest("blake3", h.hexdigest())
            else:
                still.append((t, h))
        self._active = still

    def finish(self, path: str) -> dict[str, str]:
        if self._active or self._next < len(self._tensors):
            missing = [t.name for t, _ in self._active] + [
                t.name for t in self._tensors[self._next :]
            ]
            raise DataIntegrityError(f"shard {path}: tensors {missing} end past the file")
        return self.digests


class _FileLane:
    def __init__(self, size: int, sha256: bool, git_sha1: bool) -> None:
        self.sha256 = hashlib.sha256() if sha256 else None
        self.sha1 = None
        if git_sha1:
            self.sha1 = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)

    @property
    def active(self) -> bool:
        return self.sha256 is not None or self.sha1 is not None

    def feed(self, block: memoryview) -> None:
        if self.sha256 is not None:
            self.sha256.update(block)
        if self.sha1 is not None:
            self.sha1.update(block)


@dataclass
class Progress:
    """Bytes hashed so far; ``on_advance`` is called (from hashing threads) as it grows."""

    total: int
    on_advance: Callable[[int, int], None] | None = None
    done: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            done = self.done
        if self.on_advance is not None:
            self.on_advance(done, self.total)


class _Either(threading.Event):
    """Set by this pass (a shard failed) or by its caller's ``cancel``; setting it never
    sets the caller's event."""

    def __init__(self, cancel: threading.Event) -> None:
        super().__init__()
        self._cancel = cancel

    def is_set(self) -> bool:
        return super().is_set() or self._cancel.is_set()


class HashingStopped(Exception):
    """A shard's hashing stopped because the whole pass was given up (see :func:`hash_shards`)."""


def hash_shard(
    job: ShardJob,
    progress: Progress | None = None,
    block_bytes: int = BLOCK_BYTES,
    depth: int = DEPTH,
    fadvise: bool = True,
    stop: threading.Event | None = None,
) -> ShardDigests:
    """Read ``job``'s file once; return its SHA-256 and every tensor's BLAKE3.

    ``stop``: checked before each block; once set, :class:`HashingStopped` is raised.
    """
    file_lane = _FileLane(job.size, job.sha256, job.git_sha1)
    tensor_lane = _TensorLane(job.tensors)
    buffers = [bytearray(block_bytes) for _ in range(max(1, depth))]
    inflight: deque[tuple[int, Future[None] | None, Future[None]]] = deque()
    if fadvise and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(job.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def drain_one() -> None:
        n, a, b = inflight.popleft()
        if a is not None:
            a.result()
        b.result()
        if progress is not None:
            progress.add(n)

    with (
        ThreadPoolExecutor(1, thread_name_prefix="weightd-sha") as sha_lane,
        ThreadPoolExecutor(1, thread_name_prefix="weightd-b3") as b3_lane,
    ):
        try:
            for i, offset in enumerate(range(0, job.size, block_bytes)):
                if stop is not None and stop.is_set():
                    raise HashingStopped(job.path)
                if len(inflight) == len(buffers):
                    drain_one()  # frees buffers[i % depth], the oldest in flight
                if fadvise and hasattr(os, "posix_fadvise"):
                    # Ask the kernel to start reading the block after those in flight, so
                    # the disk keeps busy while the lanes hash (a no-op when cached).
                    ahead = offset + len(buffers) * block_bytes
                    if ahead < job.size:
                        os.posix_fadvise(job.fd, ahead, block_bytes, os.POSIX_FADV_WILLNEED)
                view = memoryview(buffers[i % len(buffers)])[: min(block_bytes, job.size - offset)]
                got = os.preadv(job.fd, [view], offset)
                if got != len(view):
                    now = os.fstat(job.fd).st_size
                    raise DataIntegrityError(
                        f"shard {job.path}: short read at offset {offset} ({got} of {len(view)} "
                        f"bytes); the file is {now} bytes now, {job.size} when opened"
                    )
                inflight.append(
                    (
                        len(view),
                        sha_lane.submit(file_lane.feed, view) if file_lane.active else None,
                        b3_lane.submit(tensor_lane.feed, offset, view),
                    )
                )
            while inflight:
                drain_one()
        finally:
            for _, a, b in inflight:  # on an error, let the lanes finish with the buffers
                if a is not None:
                    a.cancel()
                b.cancel()
    if job.check is not None:
        job.check()
    return ShardDigests(
        size=job.size,
        sha256=file_lane.sha256.hexdigest() if file_lane.sha256 is not None else "",
        tensors=tensor_lane.finish(job.path),
        git_sha1=file_lane.sha1.hexdigest() if file_lane.sha1 is not None else "",
    )


def hash_shards(
    jobs: Sequence[ShardJob],
    threads: int | None = None,
    progress: Progress | None = None,
    block_bytes: int = BLOCK_BYTES,
    *,
    cancel: threading.Event | None = None,
) -> dict[str, ShardDigests]:
    """:func:`hash_shard` for every job, ``threads`` shards at a time (default: cores).

    Biggest shards start first so a lone large shard does not finish last by itself.

    Anything that ends the wait early (a shard's error, a signal raised in this thread
    to stop start-up) stops the whole pass within a block: shards not started are
    dropped and those hashing stop, so a Ctrl-C is not followed by minutes of hashing
    (and a progress bar drawn on to 100 %) before the daemon exits. ``cancel`` does the
    same from another thread (the pass then raises :class:`HashingStopped`).
    """
    if not jobs:
        return {}
    workers = max(1, min(threads or os.cpu_count() or 1, len(jobs)))
    ordered = sorted(jobs, key=lambda j: -j.size)
    stop = threading.Event() if cancel is None else _Either(cancel)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="weightd-hash")
    try:
        futures = {
            j.name: pool.submit(hash_shard, j, progress, block_bytes, stop=stop) for j in ordered
        }
        return {name: futures[name].result() for name in (j.name for j in jobs)}
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
