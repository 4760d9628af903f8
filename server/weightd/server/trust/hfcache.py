"""A Hugging Face cache snapshot as a trust source.

``huggingface_hub`` stores a repository as ``models--ORG--NAME/blobs/<id>`` plus
``snapshots/<revision>/<file>``, each file a symlink to ``../../blobs/<id>``. For an
LFS file (every ``.safetensors`` shard) the blob id *is* the file's SHA-256, as the
hub reported it; for a small git file (``config.json``) it is git's blob SHA-1. So
a snapshot carries, in its file names, a digest of each file: weightd checks that
every file it reads is such a link, resolving into that repository's ``blobs/``
directory and nowhere else, and that the bytes hash to the name.

What this proves: the bytes are the ones the hub named when they were downloaded —
no bit rot, no truncated download, no in-place edit. What it does not prove: origin.
Whoever can write the cache can put any file there under its own correct digest and
point the link at it; the revision directory name is not checked against the hub
(weightd works offline). For origin, use a signed manifest.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ..base.errors import BlobLinkError, CheckpointError, DigestMismatchError, NotASnapshotError
from ..base.paths import ConfinedDir

_SHA256: Final = re.compile(r"^[0-9a-f]{64}$")
_SHA1: Final = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True, slots=True)
class Snapshot:
    repo: str  # .../models--ORG--NAME
    blobs: str  # .../models--ORG--NAME/blobs
    revision: str


def snapshot_of(model_dir: str) -> Snapshot:
    """The cache repository a snapshot directory belongs to; refuses anything else."""
    real = os.path.realpath(model_dir)
    parent = os.path.dirname(real)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) != "snapshots" or not os.path.basename(repo).startswith("models--"):
        raise NotASnapshotError(
            model_dir,
            f"resolves to {real}, not a Hugging Face cache snapshot "
            "(.../models--ORG--NAME/snapshots/REVISION)",
        )
    blobs = os.path.join(repo, "blobs")
    if not os.path.isdir(blobs) or os.path.islink(blobs):
        raise NotASnapshotError(model_dir, f"cache repository {repo} has no blobs/ directory")
    return Snapshot(repo, blobs, os.path.basename(real))


def open_snapshot(snapshot: Snapshot) -> ConfinedDir:
    """The snapshot directory, opened under its repository by descriptor.

    The repository is the root every name is resolved in, so the snapshot's links into
    ``../../blobs`` are followed by descriptor; a file may resolve only into the
    snapshot itself or ``blobs/``, nowhere else in (or out of) the cache.
    """
    with ConfinedDir.open(snapshot.repo, label="the cache repository") as repo:
        return repo.subdir(
            f"snapshots/{snapshot.revision}", label="the model directory", also=("blobs",)
        )


def blob_kind(real_path: str) -> str:
    """``"sha256"`` or ``"git_sha1"``: what a blob's file name is the digest of."""
    name = os.path.basename(real_path)
    if _SHA256.match(name):
        return "sha256"
    if _SHA1.match(name):
        return "git_sha1"
    return ""


def check_link(
    snapshot: Snapshot, root: str, name: str, real_path: str, linked: bool
) -> CheckpointError | None:
    """A problem when ``root/name`` is not a link to a content-named blob of ``snapshot``.

    ``real_path`` and ``linked`` are what opening the file by descriptor found (see
    :mod:`weightd.server.base.paths`), never a second look at the path.
    """
    path = os.path.join(root, name)
    if not linked:
        return BlobLinkError(
            path, "is a regular file, not a link into the cache's blobs/ (cannot check its name)"
        )
    if os.path.dirname(real_path) != os.path.realpath(snapshot.blobs):
        return BlobLinkError(path, f"links to {real_path}, not into {snapshot.blobs}")
    if not blob_kind(real_path):
        return BlobLinkError(
            path, f"links to blob {os.path.basename(real_path)!r}, which is not a digest name"
        )
    return None


@dataclass(frozen=True, slots=True)
class HashedFile:
    real_path: str
    sha256: str
    git_sha1: str  # "" when not computed


def compare_blobs(root: str, files: Mapping[str, HashedFile]) -> list[CheckpointError]:
    """Every file whose bytes do not hash to its blob's name."""
    problems: list[CheckpointError] = []
    for name, f in files.items():
        blob = os.path.basename(f.real_path)
        kind = blob_kind(f.real_path)
        actual = f.sha256 if kind == "sha256" else f.git_sha1
        if actual != blob:
            what = "sha256" if kind == "sha256" else "git blob sha1"
            problems.append(
                DigestMismatchError(
                    os.path.join(root, name),
                    f"{what} is {actual or '(not computed)'}, but its cache blob is named {blob}",
                )
            )
    return problems
