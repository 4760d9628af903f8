"""Reading a checkpoint directory: open each file once, parse it, collect every problem.

:func:`scan_checkpoint` does the I/O: it opens each file once (confined to the model
directory; shards through the store, which keeps the descriptor), reads only headers
and small JSON files, and collects every problem it can find rather than stopping at
the first, so ``weightd verify`` can list them all. :func:`load_checkpoint` is the
strict form: first problem raised, nothing returned.

Why apart from :mod:`.description`: that module is the pure half (parsing bytes,
cross-checking, the description types); this one owns the descriptors, the size
bound on what is read, and the store the caller inherits.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Final

from ..base.errors import CheckpointError, MissingFileError
from ..base.paths import ConfinedDir
from ..store.shards import ShardStore
from .description import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    Checkpoint,
    SmallFile,
    cross_check,
    git_blob_sha1,
    parse_config,
    parse_index,
)
from .header import Header, header_length, parse_header

#: Largest config.json / index accepted: they are small JSON files (a 1T-parameter
#: MoE index is ~10 MB); a bound stops a hostile multi-GB file from exhausting memory.
MAX_JSON_BYTES: Final = 64 << 20


def read_small(
    directory: ConfinedDir, name: str, limit: int | None = None
) -> tuple[bytes, SmallFile]:
    """Read a small JSON file in ``directory``, by descriptor (a FIFO or a link out is
    refused).

    A file over ``limit`` bytes (default :data:`MAX_JSON_BYTES`) is refused from its
    size, before a byte of it is read.
    """
    if limit is None:
        limit = MAX_JSON_BYTES
    opened = directory.open_file(name)
    path = os.path.join(directory.path, name)
    if opened.stat.st_size > limit:
        os.close(opened.fd)
        raise CheckpointError(
            path, f"{opened.stat.st_size} bytes, larger than the {limit}-byte limit"
        )
    try:
        with os.fdopen(opened.fd, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror}") from None
    if len(raw) > limit:
        raise CheckpointError(path, f"larger than the {limit}-byte limit")
    digest = hashlib.sha256(raw).hexdigest()
    return raw, SmallFile(
        name, len(raw), digest, git_blob_sha1(raw), opened.real_path, opened.linked
    )


def read_header(store: ShardStore, shard: str) -> Header:
    """Open ``shard`` in the store and parse its header (the only bytes read at load)."""
    opened = store.open(shard)
    size = opened.identity.size
    prefix = os.pread(opened.fd, 8, 0)
    length = header_length(opened.path, prefix, size)
    raw = store.read_exact(shard, 8, length)
    return parse_header(opened.path, raw, size)


@dataclass
class Scan:
    """What :func:`scan_checkpoint` found: a description when consistent, and every problem."""

    root: str
    name: str
    store: ShardStore
    config: dict[str, Any] | None
    checkpoint: Checkpoint | None
    problems: list[CheckpointError]
    small_files: dict[str, SmallFile]
    shard_names: list[str]


def scan_checkpoint(
    model_dir: str, name: str | None = None, *, directory: ConfinedDir | None = None
) -> Scan:
    """Open and parse a checkpoint directory, collecting every problem it can.

    ``model_dir`` is opened once (or ``directory`` given, already open: a cache
    snapshot, whose links may reach its blobs) and every file is opened relative to
    that descriptor, so a directory swapped meanwhile cannot lead the reads elsewhere.
    Reading goes on past a problem where the rest does not depend on it: every shard
    header is parsed even when one is broken. ``checkpoint`` is None when anything is
    wrong. The caller owns ``store``, closing it on failure; the directory is closed
    when the scan ends.
    """
    scan = _scan(model_dir, name, directory=directory)
    scan.store.finish_opening()
    return scan


def _scan(model_dir: str, name: str | None = None, *, directory: ConfinedDir | None = None) -> Scan:
    """:func:`scan_checkpoint`'s work; the directory is the store's (even on an error)."""
    if directory is None:
        try:
            directory = ConfinedDir.open(model_dir)
        except CheckpointError as exc:
            root = os.path.realpath(model_dir)
            store = ShardStore(root)
            return Scan(root, name or os.path.basename(root), store, None, None, [exc], {}, [])
    root = directory.path
    model_name = name or os.path.basename(root)
    store = ShardStore(root, directory)
    scan = Scan(root, model_name, store, None, None, [], {}, [])
    config_raw = b""
    try:
        config_raw, small = read_small(directory, CONFIG_FILE)
        scan.small_files[CONFIG_FILE] = small
        scan.config = parse_config(os.path.join(root, CONFIG_FILE), config_raw)
    except CheckpointError as exc:
        scan.problems.append(exc)
    weight_map: dict[str, str] | None = None
    index_meta: dict[str, Any] | None = None
    if directory.exists(INDEX_FILE):
        try:
            raw, small = read_small(directory, INDEX_FILE)
            scan.small_files[INDEX_FILE] = small
            weight_map, index_meta = parse_index(root, raw)
        except CheckpointError as exc:
            scan.problems.append(exc)
            return scan
        scan.shard_names = sorted(set(weight_map.values()))
    elif directory.exists(SINGLE_FILE):
        scan.shard_names = [SINGLE_FILE]
    else:
        scan.problems.append(MissingFileError(root, f"has neither {INDEX_FILE} nor {SINGLE_FILE}"))
        return scan
    headers: dict[str, Header] = {}
    for shard in scan.shard_names:
        try:
            headers[shard] = read_header(store, shard)
        except CheckpointError as exc:
            scan.problems.append(exc)
    tensors, problems = cross_check(root, weight_map, headers, index_meta)
    scan.problems.extend(problems)
    if scan.problems or scan.config is None:
        return scan
    metadata: dict[str, str] = {}
    for header in headers.values():
        metadata.update(header.metadata)
    scan.checkpoint = Checkpoint(
        name=model_name,
        root=root,
        config=scan.config,
        config_json=config_raw.decode("utf-8"),
        tensors={t.name: t for t in tensors},
        shards=tuple(headers),
        metadata=metadata,
        small_files=dict(scan.small_files),
    )
    return scan


def load_checkpoint(model_dir: str, name: str | None = None) -> tuple[Checkpoint, ShardStore]:
    """Open a Hugging Face style checkpoint directory.

    On any error every descriptor opened so far is closed and nothing is returned,
    so a half-read checkpoint can never be published.
    """
    scan = scan_checkpoint(model_dir, name)
    if scan.problems or scan.checkpoint is None:
        scan.store.close()
        raise scan.problems[0]
    return scan.checkpoint, scan.store
