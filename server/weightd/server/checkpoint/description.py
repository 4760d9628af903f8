"""A checkpoint as an immutable description, built from strictly parsed bytes. Pure.

:func:`parse_config` and :func:`parse_index` parse the small JSON files (strictly:
:func:`strict_json`) from bytes already read. :func:`cross_check` combines the index
and shard headers and lists every tensor that is not in exactly one shard, where the
index says; :func:`describe` builds the :class:`Checkpoint` or raises the first problem.

Why apart from :mod:`.scan`, which opens and reads the files: nothing here
does I/O, so every parser and check can be fed crafted bytes directly (the fuzz tests
do), and the description types most of the daemon imports come without the shard store.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..base.errors import (
    CheckpointError,
    ConfigSyntaxError,
    DuplicateTensorError,
    IndexSchemaError,
    IndexSyntaxError,
    ShardAssignmentError,
    ShardFormatError,
    TotalSizeError,
)
from ..base.paths import check_relative_name
from .header import Header, strict_json_loads

CONFIG_FILE: Final = "config.json"
INDEX_FILE: Final = "model.safetensors.index.json"
SINGLE_FILE: Final = "model.safetensors"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    offset: int  # absolute file offset of the first byte
    nbytes: int


@dataclass(frozen=True, slots=True)
class SmallFile:
    """A small JSON file as it was read: its digests are of the bytes that were parsed,
    so a trust check cannot be fooled by a file swapped between hashing and parsing."""

    name: str
    size: int
    sha256: str  # hex
    git_sha1: str  # hex of git's blob id (how the Hugging Face cache names small files)
    real_path: str
    linked: bool = False  # reached through a symbolic link


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a blob holding ``data``: SHA-1 of ``b"blob <len>\\0" + data``."""
    h = hashlib.sha1(f"blob {len(data)}\0".encode(), usedforsecurity=False)
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class Checkpoint:
    name: str
    root: str
    config: Mapping[str, Any]
    config_json: str
    tensors: Mapping[str, TensorInfo]  # in (shard, offset) order
    shards: tuple[str, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)
    #: config.json and the index, digested from the very bytes that were parsed.
    small_files: Mapping[str, SmallFile] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
        return ""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _first_duplicate(value: Any, where: str) -> tuple[str, str] | None:
    """(where, key) of the first key that appears twice in any object of ``value``."""
    if isinstance(value, dict):
        dups = getattr(value, "duplicates", ())
        if dups:
            return where, dups[0]
        for key, child in value.items():
            found = _first_duplicate(child, f"{where}[{key!r}]" if where else repr(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found = _first_duplicate(child, f"{where}[{i}]")
            if found:
                return found
    return None


def _first_nonfinite(value: Any, where: str) -> tuple[str, str] | None:
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        token = getattr(value, "token", None)
        return (where, token) if isinstance(token, str) and not isinstance(value, str) else None
    for key, child in items:
        found = _first_nonfinite(child, f"{where}[{key!r}]" if where else repr(key))
        if found:
            return found
    return None


def strict_json(path: str, raw: bytes, error: type[CheckpointError]) -> dict[str, Any]:
    """Parse a small JSON file strictly: UTF-8, no duplicate keys, no NaN, an object."""
    try:
        doc = strict_json_loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(path, f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise error(path, f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise error(path, f"must be a JSON object, got {type(doc).__name__}")
    dup = _first_duplicate(doc, "")
    if dup:
        where = f" in {dup[0]}" if dup[0] else ""
        raise error(path, f"duplicate key {dup[1]!r}{where}")
    bad = _first_nonfinite(doc, "")
    if bad:
        raise error(path, f"field {bad[0]}: non-finite number {bad[1]} is not valid JSON")
    return doc


def parse_config(path: str, raw: bytes) -> dict[str, Any]:
    return strict_json(path, raw, ConfigSyntaxError)


def parse_index(root: str, raw: bytes) -> tuple[dict[str, str], dict[str, Any]]:
    """Return (weight_map, metadata) from the index bytes, with every file name confined."""
    path = os.path.join(root, INDEX_FILE)
    doc = strict_json(path, raw, IndexSyntaxError)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        got = "missing" if weight_map is None else f"a {type(weight_map).__name__}"
        raise IndexSchemaError(path, f"field 'weight_map' must be an object, is {got}")
    if not weight_map:
        raise IndexSchemaError(path, "field 'weight_map' is empty")
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise IndexSchemaError(
            path, f"field 'metadata' must be an object, got {type(metadata).__name__}"
        )
    total = metadata.get("total_size")
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise IndexSchemaError(
            path, f"field 'metadata.total_size' must be a non-negative integer, got {total!r}"
        )
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise IndexSchemaError(
                path,
                f"weight_map[{tensor!r}] must be a file name string, got {type(file).__name__}",
            )
        check_relative_name(root, file, what=f"weight_map[{tensor!r}]")
        if not file.endswith(".safetensors"):
            raise ShardFormatError(
                path,
                f"weight_map[{tensor!r}] names {file!r}; only .safetensors shards are read "
                "(pickle formats are never opened)",
            )
    return weight_map, metadata


def cross_check(
    root: str,
    weight_map: Mapping[str, str] | None,
    headers: Mapping[str, Header],
    index_metadata: Mapping[str, Any] | None = None,
) -> tuple[list[TensorInfo], list[CheckpointError]]:
    """Every tensor of the shards, and every way the index and shards disagree. Pure.

    With ``weight_map`` None the checkpoint is a single ``model.safetensors``.
    """
    index_path = os.path.join(root, INDEX_FILE)
    problems: list[CheckpointError] = []
    owner: dict[str, str] = {}
    tensors: list[TensorInfo] = []
    for shard, header in headers.items():
        for e in header.entries:
            if e.name in owner:
                problems.append(
                    DuplicateTensorError(
                        os.path.join(root, shard),
                        f"tensor {e.name!r} is also stored in {owner[e.name]}; each tensor must "
                        "appear in exactly one shard",
                    )
                )
                continue
            owner[e.name] = shard
            tensors.append(
                TensorInfo(e.name, e.dtype, e.shape, shard, header.data_start + e.begin, e.nbytes)
            )
    if weight_map is not None:
        for tensor, shard in weight_map.items():
            if tensor not in owner:
                if shard in headers:
                    problems.append(
                        ShardAssignmentError(
                            index_path,
                            f"weight_map[{tensor!r}] names {shard}, but that shard lacks it",
                        )
                    )
            elif owner[tensor] != shard:
                problems.append(
                    ShardAssignmentError(
                        index_path,
                        f"weight_map[{tensor!r}] names {shard}, but it is stored in "
                        f"{owner[tensor]}",
                    )
                )
        for tensor, shard in owner.items():
            if tensor not in weight_map:
                problems.append(
                    ShardAssignmentError(
                        index_path,
                        f"tensor {tensor!r} is stored in {shard} but missing from weight_map",
                    )
                )
        total = (index_metadata or {}).get("total_size")
        actual = sum(t.nbytes for t in tensors)
        if total is not None and total != actual and len(headers) == len(set(weight_map.values())):
            problems.append(
                TotalSizeError(
                    index_path, f"metadata.total_size is {total!r}, the tensors hold {actual} bytes"
                )
            )
    shard_order = {s: i for i, s in enumerate(headers)}
    tensors.sort(key=lambda t: (shard_order[t.shard], t.offset))
    return tensors, problems


def describe(
    name: str,
    root: str,
    config: dict[str, Any],
    config_json: str,
    weight_map: Mapping[str, str] | None,
    headers: Mapping[str, Header],
    index_metadata: Mapping[str, Any] | None = None,
    small_files: Mapping[str, SmallFile] | None = None,
) -> Checkpoint:
    """Cross-check the index against the shard headers and build the description.

    Raises the first problem :func:`cross_check` finds.
    """
    tensors, problems = cross_check(root, weight_map, headers, index_metadata)
    if problems:
        raise problems[0]
    metadata: dict[str, str] = {}
    for header in headers.values():
        metadata.update(header.metadata)
    return Checkpoint(
        name=name,
        root=root,
        config=config,
        config_json=config_json,
        tensors={t.name: t for t in tensors},
        shards=tuple(headers),
        metadata=metadata,
        small_files=dict(small_files or {}),
    )
