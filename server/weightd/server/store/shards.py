"""The shard store: one open descriptor per shard file, and every read of tensor bytes.

How a changed file is kept from crashing the daemon: tensor bytes are only ever read
with ``pread``/``preadv`` on descriptors opened at load time, never by touching a
file mapping. A file truncated under us therefore gives a short read (an error we
raise as DATA_LOSS), not SIGBUS. A file replaced by rename leaves our descriptor on
the old inode, so we keep serving the verified bytes. A file rewritten in place
changes its size or mtime, which :meth:`ShardStore.check` compares after every read,
and its bytes no longer hash to the verified digests, which the service checks per slice.

Why ctime is not part of the serving check: ``chmod``, ``chown``, a new hard link or an
xattr change ctime and nothing else, and must not take a healthy model down. A
rewrite that restores its mtime (``utime``, the file owner can) is the one content
change only ctime shows; every served byte is still compared with its verified
digest, and the daemon's file watcher (:mod:`weightd.server.registry.filewatch`)
re-hashes a shard whose ctime moved. Verification itself uses the strict
:meth:`ShardStore.check_identical`, because the hash cache records the identity of the
bytes it hashed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from ..base.errors import DataIntegrityError
from ..base.paths import ConfinedDir
from .runs import RunPattern

#: Gaps between wanted segments up to this size are read into a scratch buffer so a
#: batch of rows costs one ``preadv`` (copying 64 KiB costs about what a syscall does).
MAX_GAP_BYTES: Final = 64 << 10
_IOV_MAX: Final = 1024
#: Largest single read: Linux transfers at most 0x7ffff000 bytes per read call.
_MAX_READ_BYTES: Final = 1 << 30
#: Rows batched into one ``_read_rows`` call when filling a destination in place.
_ROW_BATCH_BYTES: Final = 64 << 20


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What ``fstat`` says about a file; any change means the bytes may have changed."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def content_change(was: FileIdentity, now: FileIdentity) -> str | None:
    """How ``now`` shows the bytes of ``was`` may have changed, or None (pure).

    Inode, size and mtime; a ctime-only change is metadata (see the module docstring).
    """
    if (now.dev, now.ino) != (was.dev, was.ino):
        return f"it is another file now (inode {was.ino} -> {now.ino})"
    if now.size != was.size:
        return f"size changed from {was.size} to {now.size} bytes"
    if now.mtime_ns != was.mtime_ns:
        return "it was modified in place (mtime changed)"
    return None


@dataclass(frozen=True, slots=True)
class OpenShard:
    name: str
    path: str
    fd: int
    identity: FileIdentity
    real_path: str = ""  # where the name resolved when opened (a cache blob, say)
    nlink: int = 1  # links when opened: unlinking (a rename over the path) changes ctime
    linked: bool = False  # reached through a symbolic link


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a pattern's bytes in output order, as :func:`pattern_pieces` cuts them.

    ``rows`` None: ``size`` bytes at file ``offset``. Otherwise rows ``rows[0]..rows[1]``
    of the pattern, gathered (``offset`` unused).
    """

    size: int
    offset: int = 0
    rows: tuple[int, int] | None = None


def pattern_pieces(pattern: RunPattern, max_bytes: int) -> Iterator[Piece]:
    """How a pattern's bytes are cut into pieces of at most ``max_bytes`` (pure).

    A pattern of one row, or rows of ``max_bytes`` or more, is cut along its file
    ranges; smaller rows are gathered, as many whole rows per piece as fit.
    """
    rb = pattern.row_bytes
    if pattern.count == 1 or rb >= max_bytes:
        for i in range(pattern.count):
            row = pattern.base + i * pattern.stride
            for off, length in pattern.segments:
                pos = 0
                while pos < length:
                    n = min(max_bytes, length - pos)
                    yield Piece(n, row + off + pos)
                    pos += n
        return
    rows_per_piece = max(1, max_bytes // rb)
    for lo in range(0, pattern.count, rows_per_piece):
        hi = min(pattern.count, lo + rows_per_piece)
        yield Piece((hi - lo) * rb, rows=(lo, hi))


class ShardStore:
    """Owns the descriptors of one model's shards; thread-safe for concurrent reads."""

    def __init__(self, root: str, directory: ConfinedDir | None = None) -> None:
        self.root = root
        #: The model directory, open by descriptor: every shard is opened relative to it
        #: (see :mod:`weightd.server.base.paths`). Opened on first use when not given;
        #: the store owns it until :meth:`finish_opening`.
        self._directory = directory
        self._opening = True
        self._shards: dict[str, OpenShard] = {}
        self._scratch = bytearray(MAX_GAP_BYTES)
        self._lock = threading.Lock()
        self._closed = False

    def open(self, name: str) -> OpenShard:
        with self._lock:
            if name in self._shards:
                return self._shards[name]
            if not self._opening:
                raise RuntimeError(f"shard {name!r} asked for after {self.root} was closed")
            if self._directory is None:
                self._directory = ConfinedDir.open(self.root)
            f = self._directory.open_file(name)
            shard = OpenShard(
                name,
                os.path.join(self.root, name),
                f.fd,
                FileIdentity.of(f.stat),
                f.real_path,
                f.stat.st_nlink,
                f.linked,
            )
            self._shards[name] = shard
            return shard

    @classmethod
    def of_descriptor(cls, root: str, name: str, fd: int) -> ShardStore:
        """A store of one shard already open as ``fd`` (a sealed memfd a trainer handed
        over: :mod:`weightd.server.registry.memory`); the store owns ``fd`` from now on
        and closes it with the store."""
        store = cls(root)
        st = os.fstat(fd)
        path = os.path.join(root, name)
        store._shards[name] = OpenShard(name, path, fd, FileIdentity.of(st), path)
        store._opening = False
        return store

    def finish_opening(self) -> None:
        """Every shard is open: let go of the directory (its descriptor is not needed
        to read them, and a model should hold only its shards' descriptors)."""
        with self._lock:
            self._opening = False
            if self._directory is not None:
                self._directory.close()
                self._directory = None

    def shard(self, name: str) -> OpenShard:
        return self._shards[name]

    @property
    def shards(self) -> dict[str, OpenShard]:
        return dict(self._shards)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for shard in self._shards.values():
                os.close(shard.fd)
            self._opening = False
            if self._directory is not None:
                self._directory.close()
                self._directory = None

    # --- integrity -----------------------------------------------------------------

    def check(self, name: str) -> None:
        """Raise DataIntegrityError when the shard's content may have changed since verified.

        Compares inode, size and mtime (see the module docstring for why not ctime).
        """
        shard = self._shards[name]
        what = content_change(shard.identity, FileIdentity.of(os.fstat(shard.fd)))
        if what is not None:
            raise DataIntegrityError(f"shard {shard.path} changed since it was verified: {what}")

    def check_identical(self, name: str) -> None:
        """Raise DataIntegrityError unless ``fstat`` is exactly as when the shard was opened.

        Used around hashing at load: digests recorded (in the hash cache too) under an
        identity must describe exactly the bytes hashed, so ctime counts here.
        """
        shard = self._shards[name]
        st = os.fstat(shard.fd)
        now = FileIdentity.of(st)
        if now != shard.identity:
            was = shard.identity
            if st.st_nlink < shard.nlink and content_change(was, now) is None:
                # Unlinked (e.g. a new version renamed over the path): that changes the
                # ctime of the inode we hold, not its bytes; they are still checked
                # against their digests before they leave.
                return
            what = content_change(was, now) or "its ctime changed (metadata or a rewrite)"
            raise DataIntegrityError(f"shard {shard.path} changed since it was verified: {what}")

    def _short(self, shard: OpenShard, offset: int, want: int, got: int) -> DataIntegrityError:
        size = os.fstat(shard.fd).st_size
        return DataIntegrityError(
            f"shard {shard.path}: short read at offset {offset} ({got} of {want} bytes); "
            f"the file is {size} bytes now, {shard.identity.size} when verified"
        )

    # --- reads ----------------------------------------------------------------------

    def read_exact(self, name: str, offset: int, n: int) -> bytes:
        shard = self._shards[name]
        data = os.pread(shard.fd, n, offset)
        if len(data) != n:
            raise self._short(shard, offset, n, len(data))
        return data

    def read_into(self, name: str, offset: int, dst: memoryview) -> None:
        shard = self._shards[name]
        got = os.preadv(shard.fd, [dst], offset)
        if got != len(dst):
            raise self._short(shard, offset, len(dst), got)

    def iter_pattern(
        self, name: str, pattern: RunPattern, max_bytes: int
    ) -> Iterator[bytes | bytearray]:
        """Yield the pattern's bytes in output order, in pieces of at most ``max_bytes``.

        The shard's identity is checked after every piece, so a piece is only handed
        out if the file was unchanged while it was read. Each piece is a new object
        that nothing else holds (rows gathered into a ``bytearray`` are handed out as
        they are, not copied again into ``bytes``).
        """
        for piece in pattern_pieces(pattern, max_bytes):
            if piece.rows is None:
                data: bytes | bytearray = self.read_exact(name, piece.offset, piece.size)
                self.check(name)
            else:
                data = bytearray(piece.size)
                self.read_piece_into(name, pattern, piece, memoryview(data))
            yield data

    def read_piece_into(
        self, name: str, pattern: RunPattern, piece: Piece, dst: memoryview
    ) -> None:
        """Read one piece of :func:`pattern_pieces` straight into ``dst`` (its exact size).

        The Fetch stream reads each piece into the message that carries it, so the
        bytes are copied once, from the page cache into the message (see
        :mod:`weightd.server.rpc.wire`). The shard's identity is checked afterwards,
        as :meth:`iter_pattern` does per piece.
        """
        if len(dst) != piece.size:
            raise ValueError(f"destination holds {len(dst)} bytes, the piece {piece.size}")
        if piece.rows is None:
            self.read_into(name, piece.offset, dst)
        else:
            self._read_rows(name, pattern, piece.rows[0], piece.rows[1], dst)
        self.check(name)

    def read_pattern_into(self, name: str, pattern: RunPattern, dst: memoryview) -> None:
        """Read the pattern's bytes, in output order, straight into ``dst`` (its exact size).

        Rank packs are filled this way: from the page cache into their shared memory
        with no intermediate buffer. The shard's identity is checked after the last
        read, as :meth:`iter_pattern` does per piece.
        """
        if len(dst) != pattern.nbytes:
            raise ValueError(f"destination holds {len(dst)} bytes, the pattern {pattern.nbytes}")
        rb = pattern.row_bytes
        out = 0
        if pattern.count == 1 or rb > _ROW_BATCH_BYTES:
            for off, length in pattern.ranges():
                pos = 0
                while pos < length:
                    n = min(_MAX_READ_BYTES, length - pos)
                    self.read_into(name, off + pos, dst[out : out + n])
                    pos += n
                    out += n
        else:
            rows = max(1, _ROW_BATCH_BYTES // rb)
            for lo in range(0, pattern.count, rows):
                hi = min(pattern.count, lo + rows)
                n = (hi - lo) * rb
                self._read_rows(name, pattern, lo, hi, dst[out : out + n])
                out += n
        self.check(name)

    def _read_rows(self, name: str, p: RunPattern, lo: int, hi: int, dst: memoryview) -> None:
        """Read rows ``lo..hi`` of ``p`` into ``dst`` with as few ``preadv`` calls as fit."""
        shard = self._shards[name]
        scratch = memoryview(self._scratch)
        iov: list[memoryview] = []
        start = -1  # file offset where the pending iov list begins
        cursor = 0  # file offset just past the pending iov list
        out = 0  # bytes of dst filled so far

        def flush() -> None:
            if not iov:
                return
            total = sum(len(v) for v in iov)
            got = os.preadv(shard.fd, iov, start)
            if got != total:
                raise self._short(shard, start, total, got)
            iov.clear()

        for i in range(lo, hi):
            row = p.base + i * p.stride
            for off, length in p.segments:
                if not length:
                    continue
                pos = row + off
                gap = pos - cursor
                if not iov or gap > MAX_GAP_BYTES or len(iov) >= _IOV_MAX - 2:
                    flush()
                    start = pos
                elif gap:
                    iov.append(scratch[:gap])
                iov.append(dst[out : out + length])
                out += length
                cursor = pos + length
        flush()
