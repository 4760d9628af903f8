"""Checking a shard against the manifest while it downloads, tensor by tensor.

A file's SHA-256 can only be compared once the whole file is on disk; a manifest
also gives every tensor's dtype, shape, shard and BLAKE3. So as soon as a shard's
header bytes are down it is parsed (strictly, as the local reader does) and compared
with the manifest's tensors, and as soon as all of one tensor's bytes are down they
are hashed and compared with its digest: a tampered bucket is refused at the first
tensor that differs, not after a multi-GiB download. Memory stays bounded (tensors
are read back from the file in 1 MiB pieces).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Final

import blake3

from ..base.errors import DigestMismatchError, ManifestMismatchError, ObjectTruncated
from ..checkpoint.header import Header, header_length, parse_header
from ..trust.manifest import Manifest
from .journal import Range
from .location import S3Location
from .s3 import RemoteObject

#: Bytes read back at a time: small enough to stay in the core's cache between the copy
#: and the hashers that read it (SHA-256, then BLAKE3); an 8 MiB buffer went out to
#: memory and back for each, and cost the checker ~15 % more CPU per byte (measured).
_READ: Final = 1 << 20


def covered(start: int, end: int, part_bytes: int, done_starts: set[int]) -> bool:
    """True when every planned range touching ``[start, end)`` is done (pure)."""
    if end <= start:
        return True
    first, last = start // part_bytes, (end - 1) // part_bytes
    return all(i * part_bytes in done_starts for i in range(first, last + 1))


@dataclass
class FileHashes:
    """What one pass over a downloaded file computed."""

    sha256: str = ""  # hex; "" when not asked for (no manifest)
    md5: str = ""  # hex; "" when not asked for (a manifest, or no plain-MD5 ETag)
    #: Every tensor's ``blake3:<hex>``, in file order, with its byte range: what the
    #: local verification would hash again (the hash cache is seeded with it).
    tensors: list[tuple[str, int, int, str]] = field(default_factory=list)


@dataclass
class _File:
    cursor: int = 0  # bytes [0, cursor) were hashed
    sha256: Any = None
    md5: Any = None
    head: bytearray = field(default_factory=bytearray)
    header: Header | None = None
    #: (name, start, end) of each tensor not yet finished, in file order.
    pending: list[tuple[str, int, int]] = field(default_factory=list)
    current: Any = None  # the BLAKE3 of pending[0], once its first byte is in
    result: FileHashes = field(default_factory=FileHashes)


class TensorChecker:
    """Every byte of a download hashed once, in order, as its ranges land.

    Called after each finished range (on the download's one checker thread) with the
    file's descriptor and its finished ranges: the contiguous prefix not yet hashed is
    read back (from the page cache) and fed, in one pass, to the file's SHA-256 (with a
    manifest), its MD5 (without one, for a plain-MD5 ETag) and the BLAKE3 of each
    tensor it covers. A shard's header is parsed and compared with the manifest as soon
    as its bytes are in, each tensor's digest as soon as its last byte is; the results
    (:meth:`finish`) are what the file check compares and what seeds the hash cache, so
    the local verification does not hash the same bytes again.
    """

    def __init__(
        self,
        location: S3Location,
        manifest: Manifest | None,
        part_bytes: int,
        md5: AbstractSet[str] = frozenset(),
        sha256: bool = False,
    ) -> None:
        self.location = location
        self.manifest = manifest
        #: Each file's SHA-256 (a manifest's, or an OMS signature's to compare with).
        self._sha256 = sha256 or manifest is not None
        self.part_bytes = part_bytes
        self._md5 = md5
        self._files: dict[str, _File] = {}
        self._lock = threading.Lock()
        self._buf: memoryview | None = None
        #: Tensors whose bytes were compared with the manifest while downloading.
        self.checked = 0
        #: Bytes hashed (each file's bytes once).
        self.hashed = 0

    def _state(self, obj: RemoteObject) -> _File:
        with self._lock:
            f = self._files.get(obj.name)
            if f is None:
                f = self._files[obj.name] = _File()
                if self._sha256:
                    f.sha256 = hashlib.sha256()
                elif obj.name in self._md5:
                    f.md5 = hashlib.md5(usedforsecurity=False)
            return f

    def __call__(self, obj: RemoteObject, fd: int, done: AbstractSet[Range]) -> None:
        f = self._state(obj)
        starts = {a for a, _ in done}
        end = f.cursor
        while end < obj.size and end in starts:
            end = min(end + self.part_bytes, obj.size)
        self._feed(obj, f, fd, end)

    def finish(self, obj: RemoteObject, path: str) -> FileHashes:
        """The file's hashes, its last bytes (those no range check reached: a file found
        complete on resume) read from ``path`` first."""
        f = self._state(obj)
        if f.cursor < obj.size or (obj.size == 0 and f.header is None):
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                self._feed(obj, f, fd, obj.size)
            finally:
                os.close(fd)
        uri = self.location.object_uri(obj.name)
        if f.cursor != obj.size or f.pending:
            raise ObjectTruncated(uri, f"{f.cursor} of {obj.size} bytes could be read back")
        if obj.name.endswith(".safetensors") and f.header is None:
            header_length(uri, bytes(f.head[:8]), obj.size)  # raises: too short for one
        if f.sha256 is not None:
            f.result.sha256 = f.sha256.hexdigest()
        if f.md5 is not None:
            f.result.md5 = f.md5.hexdigest()
        return f.result

    def _feed(self, obj: RemoteObject, f: _File, fd: int, end: int) -> None:
        if f.cursor >= end:
            return
        buf = self._buffer()
        while f.cursor < end:
            n = min(len(buf), end - f.cursor)
            got = 0
            while got < n:  # straight into the buffer: no copy before the hashers
                k = os.preadv(fd, [buf[got:n]], f.cursor + got)
                if k <= 0:
                    raise ObjectTruncated(
                        self.location.object_uri(obj.name),
                        f"{f.cursor + got} of {obj.size} bytes could be read back",
                    )
                got += k
            self._take(obj, f, buf[:n])

    def _buffer(self) -> memoryview:
        """The read-back buffer (calls come from one checker thread at a time)."""
        with self._lock:
            if self._buf is None:
                self._buf = memoryview(bytearray(_READ))
            return self._buf

    def _take(self, obj: RemoteObject, f: _File, piece: memoryview) -> None:
        at = f.cursor
        if f.sha256 is not None:
            f.sha256.update(piece)
        if f.md5 is not None:
            f.md5.update(piece)
        f.cursor += len(piece)
        self.hashed += len(piece)
        if not obj.name.endswith(".safetensors"):
            return
        uri = self.location.object_uri(obj.name)
        if f.header is None:
            # The file's first bytes, kept until the header is whole (bounded by the
            # header's own cap, which header_length enforces).
            f.head += piece
            if len(f.head) < 8:
                return
            need = 8 + header_length(uri, bytes(f.head[:8]), obj.size)
            if len(f.head) < need:
                return
            f.header = parse_header(uri, bytes(f.head[8:need]), obj.size)
            f.head = bytearray()
            if self.manifest is not None:
                self._compare_header(uri, obj.name, f.header)
            entries = sorted(f.header.entries, key=lambda e: e.begin)
            start = f.header.data_start
            f.pending = [(e.name, start + e.begin, start + e.end) for e in entries]
        self._tensors(uri, f, piece, at)

    def _tensors(self, uri: str, f: _File, piece: memoryview, at: int) -> None:
        """Feed ``piece`` (bytes ``[at, at + len)``) to the tensors it covers, in order,
        finishing (and judging) each whose last byte it holds."""
        end = at + len(piece)
        view = piece
        while f.pending:
            name, a, b = f.pending[0]
            if a >= end and a != b:
                return
            if f.current is None:
                f.current = blake3.blake3()
            lo, hi = max(a, at), min(b, end)
            if lo < hi:
                f.current.update(view[lo - at : hi - at])
            if b > end:
                return
            digest = f"blake3:{f.current.hexdigest()}"
            f.current = None
            f.pending.pop(0)
            f.result.tensors.append((name, a, b - a, digest))
            if self.manifest is not None:
                want = self.manifest.tensors[name].digest
                if digest != want:
                    raise DigestMismatchError(
                        uri,
                        f"tensor {name!r}: {digest}, manifest {self.manifest.path} says {want}: "
                        "the bucket does not hold the manifest's bytes; the download stopped "
                        "at this tensor",
                    )
                self.checked += 1

    def _compare_header(self, uri: str, name: str, header: Header) -> None:
        assert self.manifest is not None
        mine = {t: e for t, e in self.manifest.tensors.items() if e.file == name}
        seen = {e.name for e in header.entries}
        for entry in header.entries:
            want = mine.get(entry.name)
            if want is None:
                raise ManifestMismatchError(
                    uri, f"tensor {entry.name!r} is not listed in manifest {self.manifest.path}"
                )
            if (entry.dtype, tuple(entry.shape)) != (want.dtype, tuple(want.shape)):
                raise ManifestMismatchError(
                    uri,
                    f"tensor {entry.name!r} is {entry.dtype} {list(entry.shape)}, manifest "
                    f"{self.manifest.path} says {want.dtype} {list(want.shape)}",
                )
        for missing in sorted(mine.keys() - seen):
            raise ManifestMismatchError(
                uri, f"tensor {missing!r} of manifest {self.manifest.path} is not in this shard"
            )
