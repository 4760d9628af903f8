"""Checking a shard against the manifest while it downloads, tensor by tensor.

A file's SHA-256 can only be compared once the whole file is on disk; a manifest
also gives every tensor's dtype, shape, shard and BLAKE3. So as soon as a shard's
header bytes are down it is parsed (strictly, as the local reader does) and compared
with the manifest's tensors, and as soon as all of one tensor's bytes are down they
are hashed and compared with its digest: a tampered bucket is refused at the first
tensor that differs, not after a multi-GiB download. Memory stays bounded (tensors
are read back from the file in 8 MiB pieces).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Final

import blake3

from ..base.errors import DigestMismatchError, ManifestMismatchError
from ..checkpoint.header import Header, header_length, parse_header
from ..trust.manifest import Manifest
from .journal import Range
from .location import S3Location
from .s3 import RemoteObject

_READ: Final = 8 << 20


def covered(start: int, end: int, part_bytes: int, done_starts: set[int]) -> bool:
    """True when every planned range touching ``[start, end)`` is done (pure)."""
    if end <= start:
        return True
    first, last = start // part_bytes, (end - 1) // part_bytes
    return all(i * part_bytes in done_starts for i in range(first, last + 1))


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        piece = os.pread(fd, min(_READ, size - len(out)), offset + len(out))
        if not piece:
            break
        out += piece
    return bytes(out)


@dataclass
class _Shard:
    header: Header | None = None
    left: set[str] = field(default_factory=set)


class TensorChecker:
    """Called after each finished range of a download with a manifest."""

    def __init__(self, location: S3Location, manifest: Manifest, part_bytes: int) -> None:
        self.location = location
        self.manifest = manifest
        self.part_bytes = part_bytes
        self._shards: dict[str, _Shard] = {}
        #: Tensors whose bytes were compared with the manifest while downloading.
        self.checked = 0

    def __call__(self, obj: RemoteObject, fd: int, done: AbstractSet[Range]) -> None:
        if not obj.name.endswith(".safetensors"):
            return
        shard = self._shards.setdefault(obj.name, _Shard())
        starts = {a for a, _ in done}
        uri = self.location.object_uri(obj.name)
        if shard.header is None:
            if not covered(0, 8, self.part_bytes, starts):
                return
            prefix = _pread_exact(fd, 8, 0)
            length = header_length(uri, prefix, obj.size)
            if not covered(0, 8 + length, self.part_bytes, starts):
                return
            raw = _pread_exact(fd, length, 8)
            if len(raw) != length or struct.unpack("<Q", prefix)[0] != length:
                return
            shard.header = parse_header(uri, raw, obj.size)
            self._compare_header(uri, obj.name, shard.header)
            shard.left = {e.name for e in shard.header.entries}
        header = shard.header
        for entry in header.entries:
            if entry.name not in shard.left:
                continue
            a, b = header.data_start + entry.begin, header.data_start + entry.end
            if not covered(a, b, self.part_bytes, starts):
                continue
            h = blake3.blake3()
            for offset in range(a, b, _READ):
                h.update(_pread_exact(fd, min(_READ, b - offset), offset))
            got = f"blake3:{h.hexdigest()}"
            want = self.manifest.tensors[entry.name].digest
            if got != want:
                raise DigestMismatchError(
                    uri,
                    f"tensor {entry.name!r}: {got}, manifest {self.manifest.path} says {want}: "
                    "the bucket does not hold the manifest's bytes; the download stopped at "
                    "this tensor",
                )
            shard.left.discard(entry.name)
            self.checked += 1

    def _compare_header(self, uri: str, name: str, header: Header) -> None:
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
