"""A cache of shard digests, so restarting on an unchanged checkpoint skips hashing.

An entry is keyed by what ``fstat`` says of the shard — (st_dev, st_ino, size,
mtime_ns, ctime_ns) — and by its resolved path, and holds the shard's SHA-256 and
every tensor's BLAKE3 with the byte range it covers. It is used only when all of the
key is equal *and* the tensor ranges are those of the header just parsed; anything
else (another inode, a touched file, a different header) means the shard is hashed
again. ctime is in the key because no unprivileged call can set it: rewriting a file
and restoring its mtime still changes ctime.

The cache is one JSON file per model directory in the cache directory, replaced
atomically (temporary file, fsync, rename, fsync of the directory), so a crash leaves
the old file or the new one. A file that cannot be read or parsed is ignored (and
hashing happens), never trusted in part.

What the cache is trusted with: whoever can write the cache directory can make the
daemon skip hashing. So a cache file is used only when it and its directory are the
daemon's user's, writable by no one else, the file not a link and with one link
(:func:`~weightd.server.base.readfile.read_bounded` ``private``); any other is
ignored with a warning and the shards hashed. ``--reverify`` ignores it always. The
cache never replaces the fetch-time checks: every tensor is still re-hashed against
its digest the first time a layout needs it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..base.atomicio import write_atomic
from ..base.errors import OutputWriteError
from ..base.readfile import ReadRefused, read_bounded
from ..store.shards import FileIdentity
from .hashing import ShardDigests, TensorRange

log = logging.getLogger("weightd.hashcache")

CACHE_VERSION: Final = 1
MAX_CACHE_BYTES: Final = 256 << 20


@dataclass(frozen=True)
class CacheEntry:
    real_path: str
    identity: FileIdentity
    ranges: tuple[TensorRange, ...]
    digests: ShardDigests


def _key(identity: FileIdentity) -> list[int]:
    return [identity.dev, identity.ino, identity.size, identity.mtime_ns, identity.ctime_ns]


class HashCache:
    """The cached digests of one model directory's shards."""

    def __init__(self, directory: str, model_root: str) -> None:
        self.directory = directory
        self.model_root = model_root
        digest = hashlib.sha256(model_root.encode("utf-8", "surrogateescape")).hexdigest()
        self.path = os.path.join(directory, f"{digest[:32]}.json")
        self._entries: dict[str, dict[str, Any]] | None = None

    def _load(self) -> dict[str, dict[str, Any]]:
        if self._entries is not None:
            return self._entries
        self._entries = {}
        if not os.path.lexists(self.path):
            return self._entries
        try:
            raw = read_bounded(self.path, MAX_CACHE_BYTES + 1, private=True)
        except ReadRefused as exc:  # another user's file would make us skip hashing
            log.warning("hash cache %s %s; hashing again", self.path, exc.reason)
            return self._entries
        try:
            doc = json.loads(raw)
            if len(raw) > MAX_CACHE_BYTES:
                raise ValueError("too large")
            if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION:
                raise ValueError("unknown version")
            if doc.get("root") != self.model_root or not isinstance(doc.get("shards"), dict):
                raise ValueError("not this model's cache")
            self._entries = {k: v for k, v in doc["shards"].items() if isinstance(v, dict)}
        except (ValueError, RecursionError, UnicodeDecodeError) as exc:
            log.warning("hash cache %s is corrupt (%s); ignoring it", self.path, exc)
        return self._entries

    def lookup(
        self,
        shard: str,
        real_path: str,
        identity: FileIdentity,
        ranges: tuple[TensorRange, ...],
        git_sha1: bool = False,
        sha256: bool = True,
    ) -> ShardDigests | None:
        """The cached digests, only if every part of the key and the ranges match."""
        entry = self._load().get(shard)
        if entry is None:
            return None
        try:
            if entry.get("path") != real_path or entry.get("key") != _key(identity):
                return None
            cached = entry["tensors"]
            if not isinstance(cached, list) or len(cached) != len(ranges):
                return None
            tensors: dict[str, str] = {}
            for r, item in zip(ranges, cached, strict=True):
                name, offset, nbytes, digest = item
                if (name, offset, nbytes) != (r.name, r.offset, r.nbytes):
                    return None
                if not isinstance(digest, str) or not digest.startswith("blake3:"):
                    return None
                tensors[name] = digest
            sha = entry["sha256"]
            sha1 = entry.get("git_sha1", "")
            if not isinstance(sha, str) or len(sha) not in (0, 64) or not isinstance(sha1, str):
                return None
            if sha256 and len(sha) != 64:
                return None  # cached by a run that did not need the file digest
            if git_sha1 and len(sha1) != 40:
                return None
        except (KeyError, TypeError, ValueError):
            return None
        return ShardDigests(identity.size, sha, tensors, sha1)

    def update(self, entries: Mapping[str, CacheEntry]) -> None:
        """Record ``entries`` (merged with what is cached) and write the file atomically."""
        current = dict(self._load())
        for shard, e in entries.items():
            current[shard] = {
                "path": e.real_path,
                "key": _key(e.identity),
                "sha256": e.digests.sha256,
                "git_sha1": e.digests.git_sha1,
                "tensors": [
                    [r.name, r.offset, r.nbytes, e.digests.tensors[r.name]] for r in e.ranges
                ],
            }
        self._entries = current
        doc = {"version": CACHE_VERSION, "root": self.model_root, "shards": current}
        try:
            _write_atomic(self.directory, self.path, json.dumps(doc).encode())
        except OSError as exc:  # the directory itself
            log.warning("cannot write hash cache %s: %s", self.path, exc.strerror or exc)
        except OutputWriteError as exc:
            # Serving goes on: the cache only saves hashing at the next start.
            log.warning("%s; serving continues, the next start hashes again", exc)


def _write_atomic(directory: str, path: str, data: bytes) -> None:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    write_atomic(path, data, mode=0o600)
