"""What happened to a served shard's file, and whether a re-read version is the served one.

Pure: ``fstat``/``stat`` snapshots and checkpoint descriptions in, a verdict out, so
a table of cases tests every rule (the I/O lives in :mod:`.filewatch`).

A served shard is held by descriptor (see :mod:`weightd.server.store.shards`), so two
things can change:

* **the inode we hold** — a size or mtime change means its bytes may have changed
  (truncated, overwritten in place): ``CONTENT``, the model stops serving. A
  ctime-only change (``chmod``, ``chown``, a hard link, an xattr, or a rewrite that
  put its mtime back) is ``METADATA``: the shard is re-hashed in the background and
  the model keeps serving meanwhile, every byte still checked against its digest.
* **the path** — another inode there (a file renamed over it) is ``REPLACED``, no
  file at all ``REMOVED``; what we serve is unaffected (the descriptor stays on the
  verified inode), but the directory no longer holds the served version.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from ..checkpoint.description import Checkpoint
from ..store.shards import FileIdentity, content_change


class ChangeKind(enum.Enum):
    METADATA = "metadata"
    CONTENT = "content"
    REPLACED = "replaced"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class ShardChange:
    kind: ChangeKind
    detail: str  # names the file; fit for ListModels, the log and a gRPC detail


def inode_change(
    path: str, verified: FileIdentity, held_now: FileIdentity, accepted_ctime_ns: int
) -> ShardChange | None:
    """What happened to the inode we hold: ``CONTENT``, ``METADATA`` or None.

    ``verified``: the descriptor's identity when verified; ``held_now``: its ``fstat``
    now; ``accepted_ctime_ns``: the last ctime a re-hash accepted.
    """
    what = content_change(verified, held_now)
    if what is not None:
        return ShardChange(
            ChangeKind.CONTENT, f"shard {path} changed since it was verified: {what}"
        )
    if held_now.ctime_ns != accepted_ctime_ns:
        return ShardChange(
            ChangeKind.METADATA,
            f"shard {path}: only its ctime changed (chmod, chown, a link, or a rewrite that "
            "restored its mtime)",
        )
    return None


def path_change(
    path: str, verified: FileIdentity, at_path: FileIdentity | None
) -> ShardChange | None:
    """What happened to the path: ``REPLACED``, ``REMOVED`` or None (``at_path``: its ``stat``
    now, None when no file is there)."""
    if at_path is None:
        return ShardChange(ChangeKind.REMOVED, f"shard {path} was removed from disk")
    if (at_path.dev, at_path.ino) != (verified.dev, verified.ino):
        return ShardChange(
            ChangeKind.REPLACED,
            f"shard {path} was replaced on disk (inode {verified.ino} -> {at_path.ino})",
        )
    return None


def tensor_mismatch(
    path: str, digests: Mapping[str, str], verified: Mapping[str, str]
) -> str | None:
    """The first tensor of a re-hashed shard whose digest is not the verified one."""
    for name in sorted(digests):
        if digests[name] != verified.get(name):
            return (
                f"shard {path} no longer holds the verified bytes: tensor {name!r} hashes to "
                f"{digests[name]}, verified {verified.get(name)}"
            )
    return None


def version_difference(
    served: Checkpoint,
    served_digests: Mapping[str, str],
    on_disk: Checkpoint,
    disk_digests: Mapping[str, str],
) -> str | None:
    """How a freshly verified version differs from the served one, or None when it holds
    exactly the same tensors (names, dtypes, shapes, digests) and config.

    Byte offsets and shard names may differ (the same weights saved again): workers
    receive tensors, not files.
    """
    if served.config_json != on_disk.config_json:
        return "config.json differs from the served version's"
    names = served.tensors.keys() | on_disk.tensors.keys()
    for name in sorted(names):
        a, b = served.tensors.get(name), on_disk.tensors.get(name)
        if a is None:
            return f"tensor {name!r} is new (in {b.shard if b else '?'})"
        if b is None:
            return f"tensor {name!r} is gone"
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return (
                f"tensor {name!r} in {b.shard} is {b.dtype}{list(b.shape)}, "
                f"served {a.dtype}{list(a.shape)}"
            )
        if served_digests.get(name) != disk_digests.get(name):
            return (
                f"tensor {name!r} in {b.shard} hashes to {disk_digests.get(name)}, "
                f"served {served_digests.get(name)}"
            )
    return None
