"""The download engine: concurrent ranged GETs into pre-sized files, resumable.

Bounded: at most ``concurrency`` GETs in flight, each reading its body in pieces of
at most ``read_chunk`` bytes written straight to the file with ``pwrite`` at the
range's offset, so memory is ``concurrency x read_chunk`` whatever the model's size.
Each range is pinned to the object's ETag (see :meth:`S3Store.get_range_into`) and must
deliver exactly its length. Finished ranges go into the journal after an fdatasync;
a file whose ranges are all done is fsynced, checked by the caller's ``check_file``
(digests) and only then renamed from ``NAME.part`` to ``NAME``. The first failure
stops the rest (GETs in flight finish their current piece), saves the journal of what
did finish, and is raised.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from concurrent import futures
from dataclasses import dataclass
from typing import Final

from ..base.atomicio import write_error
from ..base.errors import ObjectTruncated, SourceCancelled, StorageFullError, WeightdError
from .journal import Journal, Range
from .location import S3Location
from .s3 import RemoteObject, S3Store

#: A file being downloaded is ``.part-<digest of its name>``: a name no object can
#: have (object names never start with a dot), of a fixed length whatever the object's
#: name (a 255-byte name plus a suffix would pass the file system's name limit).
PART_PREFIX: Final = ".part-"


def part_name(name: str) -> str:
    """The in-progress file of object ``name`` in a partial directory (pure)."""
    return PART_PREFIX + hashlib.sha256(name.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class DownloadSettings:
    """How a download uses the network, memory and disk."""

    #: Bytes per ranged GET (and per journal entry): what a crash can cost again.
    part_bytes: int = 16 << 20
    #: Ranged GETs in flight at once.
    concurrency: int = 8
    #: Bytes read from one response body at a time (memory per GET).
    read_chunk: int = 1 << 20
    #: Cap on the download rate (bytes per second, all GETs together); None: none.
    max_bytes_per_second: int | None = None
    #: Seconds between two saves of the journal (and two progress reports).
    journal_interval_s: float = 1.0


class Throttle:
    """A token bucket shared by the GET threads (``--s3-max-bytes-per-second``)."""

    def __init__(self, rate: int | None) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def reserve(self, n: int) -> float:
        """The seconds to wait before ``n`` more bytes are within the rate (the caller
        waits them; they are booked now)."""
        if not self.rate:
            return 0.0
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now)
            self._next = start + n / self.rate
            return max(start - now, 0.0)

    def take(self, n: int) -> float:
        """Wait until ``n`` more bytes are within the rate; returns the seconds waited."""
        delay = self.reserve(n)
        if delay > 0:
            time.sleep(delay)
        return delay


class _Stopped(Exception):
    """A GET thread saw the stop flag (another range failed, or start-up stops)."""


@dataclass
class _File:
    obj: RemoteObject
    fd: int
    part_path: str
    left: int  # ranges not yet finished
    dirty: bool = False  # ranges finished since the last fdatasync


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    view = data
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


class Download:
    """One download of ``objects`` into ``directory`` (see the module docstring)."""

    def __init__(
        self,
        store: S3Store,
        location: S3Location,
        objects: Sequence[RemoteObject],
        directory: str,
        journal: Journal,
        journal_path: str,
        settings: DownloadSettings,
        *,
        check_file: Callable[[RemoteObject, str], None],
        progress: Callable[[int, int], None] | None = None,
        on_range: Callable[[RemoteObject, int, AbstractSet[Range]], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        self.store = store
        self.location = location
        self.objects = list(objects)
        self.directory = directory
        self.journal = journal
        self.journal_path = journal_path
        self.settings = settings
        self.check_file = check_file
        self.progress = progress
        #: Called after each finished range with a descriptor of the file and its
        #: finished ranges, on one checker thread of its own so that hashing never holds
        #: up the next GETs: checks that need not wait for the whole file.
        self.on_range = on_range
        self.throttle = Throttle(settings.max_bytes_per_second)
        self.stop = threading.Event()
        #: Set by the caller to end the download early (a reload's deadline, shutdown):
        #: GETs in flight end at once (their connections are closed), nothing is published.
        self.cancel = cancel if cancel is not None else threading.Event()
        self._lock = threading.Lock()
        #: Bytes received from the store by this download (what the metrics count).
        self.fetched = 0
        self.total = sum(o.size for o in self.objects)

    def _fetch(self, f: _File, rng: Range) -> Range:
        start, end = rng
        offset = start
        s = self.settings
        uri = self.location.object_uri(f.obj.name)
        # This GET's own buffer: each piece is read into it and written from it, no
        # buffer made and copied per piece.
        buffer = memoryview(bytearray(max(1, min(s.read_chunk, end - start))))
        pieces = self.store.get_range_into(
            self.location,
            f.obj,
            start,
            end,
            buffer,
            pace=self.throttle.reserve,
            cancel=self.cancel,
        )
        for n in pieces:
            if self.stop.is_set():
                raise _Stopped
            if offset + n > end:  # get_range_into never yields more; kept as a guard
                raise ObjectTruncated(
                    uri, f"range [{start}, {end}) sent more than {end - start} bytes"
                )
            try:
                _pwrite_all(f.fd, buffer[:n], offset)
            except OSError as exc:  # ENOSPC, EDQUOT, EIO: typed, naming the cache file
                raise write_error(f.part_path, exc) from None
            offset += n
            with self._lock:
                self.fetched += n
        if offset != end:
            raise ObjectTruncated(
                uri,
                f"range [{start}, {end}) ended after {offset - start} of {end - start} bytes "
                "(short object)",
            )
        return rng

    def _open(self, obj: RemoteObject, left: int) -> _File:
        part = os.path.join(self.directory, part_name(obj.name))
        try:
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise write_error(part, exc) from None
        try:
            if os.fstat(fd).st_size != obj.size:
                os.ftruncate(fd, obj.size)
        except OSError as exc:
            os.close(fd)
            raise write_error(part, exc) from None
        return _File(obj, fd, part, left)

    def check_space(self) -> None:
        """Refuse up front when the cache's file system cannot hold what is left to fetch
        (files are sparse until written, so a full disk would otherwise show late)."""
        needed = sum(b - a for o in self.objects for a, b in self.journal.missing(o))
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if needed > free:
            raise StorageFullError(
                self.directory,
                f"{needed} bytes still to download, {free} free on its file system; "
                "nothing more was fetched",
            )

    def _save(self, files: Sequence[_File]) -> None:
        for f in files:
            if f.dirty and f.fd >= 0:
                os.fdatasync(f.fd)
                f.dirty = False
        self.journal.save(self.journal_path)

    def _finish(self, f: _File) -> None:
        os.fsync(f.fd)
        os.close(f.fd)
        f.fd = -1
        f.dirty = False
        self.check_file(f.obj, f.part_path)
        os.rename(f.part_path, os.path.join(self.directory, f.obj.name))
        self.journal.complete.add(f.obj.name)
        self.journal.done.pop(f.obj.name, None)

    def run(self) -> None:
        """Fetch every missing range; raise the first failure (journal saved either way)."""
        files: list[_File] = []
        tasks: list[tuple[_File, Range]] = []
        self.check_space()
        try:
            for obj in self.objects:
                missing = self.journal.missing(obj)
                if obj.name in self.journal.complete:
                    continue
                f = self._open(obj, len(missing))
                files.append(f)
                tasks.extend((f, r) for r in missing)
            for f in [f for f in files if f.left == 0]:  # empty files, or all ranges done
                self._finish(f)
            self._pump(files, tasks)
        finally:
            for f in files:
                if f.fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(f.fd)

    def _pump(self, files: list[_File], tasks: list[tuple[_File, Range]]) -> None:
        s = self.settings
        failure: BaseException | None = None
        pool = futures.ThreadPoolExecutor(s.concurrency, thread_name_prefix="weightd-s3")
        pending: dict[futures.Future[Range], _File] = {}
        checker = futures.ThreadPoolExecutor(1, thread_name_prefix="weightd-s3-check")
        checks: list[tuple[futures.Future[None], int]] = []
        last_check: dict[str, futures.Future[None]] = {}
        queue = list(reversed(tasks))
        last_save = time.monotonic()

        def check(obj: RemoteObject, fd: int, ranges: AbstractSet[Range]) -> None:
            try:
                if self.on_range is not None and not self.stop.is_set():
                    self.on_range(obj, fd, ranges)
            finally:
                os.close(fd)

        def check_failure() -> BaseException | None:
            for fut, _ in checks:
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    return fut.exception()
            checks[:] = [(fut, fd) for fut, fd in checks if not fut.done()]
            return None

        try:
            while queue or pending:
                while queue and len(pending) < s.concurrency and failure is None:
                    f, rng = queue.pop()
                    pending[pool.submit(self._fetch, f, rng)] = f
                done, _ = futures.wait(
                    pending, timeout=s.journal_interval_s, return_when=futures.FIRST_COMPLETED
                )
                for fut in done:
                    f = pending.pop(fut)
                    exc = fut.exception()
                    if exc is not None:
                        if failure is None or isinstance(failure, _Stopped):
                            failure = exc
                        self.stop.set()
                        continue
                    if failure is not None:
                        continue
                    done_ranges = self.journal.done.setdefault(f.obj.name, set())
                    done_ranges.add(fut.result())
                    f.dirty = True
                    f.left -= 1
                    if self.on_range is not None:
                        # Its own descriptor: _finish closes f.fd while checks may queue.
                        fd = os.dup(f.fd)
                        snapshot = frozenset(done_ranges)
                        checks.append((checker.submit(check, f.obj, fd, snapshot), fd))
                        last_check[f.obj.name] = checks[-1][0]
                    if f.left == 0:
                        # The checks run in order on one thread: once this file's last
                        # one is done, every byte of it was seen (and judged) there.
                        pending_check = last_check.pop(f.obj.name, None)
                        if pending_check is not None:
                            pending_check.result()
                        self._finish(f)
                if failure is None:
                    failure = check_failure()
                    if failure is None and self.cancel.is_set():
                        failure = SourceCancelled(
                            self.location.uri,
                            "the download was cancelled (a deadline or "
                            "shutdown); what finished is kept for the next try",
                        )
                    if failure is not None:
                        self.stop.set()
                if failure is not None:
                    queue.clear()
                now = time.monotonic()
                if now - last_save >= s.journal_interval_s:
                    last_save = now
                    self._save(files)
                    if self.progress is not None:
                        self.progress(self.journal.done_bytes(), self.total)
            if failure is None:  # every range is in: the checks still queued decide
                futures.wait([c for c, _ in checks])
                failure = check_failure()
        except BaseException as exc:  # a signal during start-up, a failed check_file
            failure = exc
            self.stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            checker.shutdown(wait=True, cancel_futures=True)
            for c, cfd in checks:
                if c.cancelled():  # never ran, so never closed its descriptor
                    with contextlib.suppress(OSError):
                        os.close(cfd)
            with contextlib.suppress(OSError, WeightdError):
                self._save([f for f in files if f.fd >= 0])
        if failure is not None:
            raise failure
        if self.progress is not None:
            self.progress(self.journal.done_bytes(), self.total)
