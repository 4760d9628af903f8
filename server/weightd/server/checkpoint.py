"""A checkpoint directory as an immutable description, built from strictly parsed files.

:func:`describe` is pure: it combines the parsed config, index and shard headers and
checks that every tensor appears in exactly one shard, where the index says.
:func:`load_checkpoint` does the I/O: it opens each shard once (through the store,
which keeps the descriptor) and reads only headers; tensor bytes are left alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from .errors import CheckpointError, ConfigError, IndexFileError, UnsafePathError
from .paths import check_relative_name, open_regular_file
from .safetensors_header import Header, header_length, parse_header
from .store import ShardStore

CONFIG_FILE: Final = "config.json"
INDEX_FILE: Final = "model.safetensors.index.json"
SINGLE_FILE: Final = "model.safetensors"
#: Largest config.json / index accepted: they are small JSON files (a 1T-parameter
#: MoE index is ~10 MB); a bound stops a hostile multi-GB file from exhausting memory.
MAX_JSON_BYTES: Final = 64 << 20


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    offset: int  # absolute file offset of the first byte
    nbytes: int


@dataclass(frozen=True)
class Checkpoint:
    name: str
    root: str
    config: Mapping[str, Any]
    config_json: str
    tensors: Mapping[str, TensorInfo]  # in (shard, offset) order
    shards: tuple[str, ...]
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
        return ""

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _strict_json(path: str, raw: bytes, error: type[CheckpointError]) -> dict[str, Any]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise error(path, f"duplicate key {key!r}")
            out[key] = value
        return out

    def constant(token: str) -> Any:
        raise error(path, f"non-finite number {token} is not valid JSON")

    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=hook, parse_constant=constant)
    except CheckpointError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise error(path, f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise error(path, f"must be a JSON object, got {type(doc).__name__}")
    return doc


def parse_config(path: str, raw: bytes) -> dict[str, Any]:
    return _strict_json(path, raw, ConfigError)


def parse_index(root: str, raw: bytes) -> tuple[dict[str, str], dict[str, Any]]:
    """Return (weight_map, metadata) from the index bytes, with every file name confined."""
    path = os.path.join(root, INDEX_FILE)
    doc = _strict_json(path, raw, IndexFileError)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict):
        raise IndexFileError(path, "missing 'weight_map' object")
    if not weight_map:
        raise IndexFileError(path, "'weight_map' is empty")
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise IndexFileError(path, "'metadata' must be an object")
    for tensor, file in weight_map.items():
        if not isinstance(file, str):
            raise IndexFileError(path, f"weight_map[{tensor!r}] must be a file name string")
        check_relative_name(root, file, what=f"weight_map[{tensor!r}]")
        if not file.endswith(".safetensors"):
            raise UnsafePathError(
                path,
                f"weight_map[{tensor!r}] names {file!r}; only .safetensors shards are read "
                "(pickle formats are never opened)",
            )
    return weight_map, metadata


def describe(
    name: str,
    root: str,
    config: dict[str, Any],
    config_json: str,
    weight_map: Mapping[str, str] | None,
    headers: Mapping[str, Header],
    index_metadata: Mapping[str, Any] | None = None,
) -> Checkpoint:
    """Cross-check the index against the shard headers and build the description.

    With ``weight_map`` None the checkpoint is a single ``model.safetensors``.
    """
    index_path = os.path.join(root, INDEX_FILE)
    owner: dict[str, str] = {}
    tensors: list[TensorInfo] = []
    for shard, header in headers.items():
        for e in header.entries:
            if e.name in owner:
                raise IndexFileError(
                    os.path.join(root, shard),
                    f"tensor {e.name!r} is also stored in {owner[e.name]}; each tensor must "
                    "appear in exactly one shard",
                )
            owner[e.name] = shard
            tensors.append(
                TensorInfo(e.name, e.dtype, e.shape, shard, header.data_start + e.begin, e.nbytes)
            )
    if weight_map is not None:
        for tensor, shard in weight_map.items():
            if tensor not in owner:
                raise IndexFileError(
                    index_path, f"tensor {tensor!r} is mapped to {shard} but that shard lacks it"
                )
            if owner[tensor] != shard:
                raise IndexFileError(
                    index_path,
                    f"tensor {tensor!r} is mapped to {shard} but is stored in {owner[tensor]}",
                )
        for tensor, shard in owner.items():
            if tensor not in weight_map:
                raise IndexFileError(
                    index_path,
                    f"tensor {tensor!r} is stored in {shard} but missing from weight_map",
                )
        total = (index_metadata or {}).get("total_size")
        actual = sum(t.nbytes for t in tensors)
        if total is not None and total != actual:
            raise IndexFileError(
                index_path, f"metadata.total_size is {total!r}, the tensors hold {actual} bytes"
            )
    shard_order = {s: i for i, s in enumerate(headers)}
    tensors.sort(key=lambda t: (shard_order[t.shard], t.offset))
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
    )


def _read_small(root: str, name: str, error: type[CheckpointError]) -> bytes:
    """Read a small JSON file of the model: confined to the root, regular, size-capped.

    Opened like a shard (no link leaving the root, no FIFO or device), so a planted
    ``config.json`` can neither hang the loader nor leak a file from elsewhere through
    DescribeModel.
    """
    path = os.path.join(root, name)
    if not os.path.lexists(path):
        raise error(path, "file does not exist")
    fd, st = open_regular_file(root, name)
    try:
        if st.st_size > MAX_JSON_BYTES:
            raise error(path, f"is {st.st_size} bytes, over the {MAX_JSON_BYTES}-byte limit")
        chunks = []
        remaining = MAX_JSON_BYTES + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as exc:
        raise error(path, f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > MAX_JSON_BYTES:
        raise error(path, f"larger than the {MAX_JSON_BYTES}-byte limit")
    return raw


def read_header(store: ShardStore, shard: str) -> Header:
    """Open ``shard`` in the store and parse its header (the only bytes read at load)."""
    opened = store.open(shard)
    size = opened.identity.size
    prefix = os.pread(opened.fd, 8, 0)
    length = header_length(opened.path, prefix, size)
    raw = store.read_exact(shard, 8, length)
    return parse_header(opened.path, raw, size)


def load_checkpoint(model_dir: str, name: str | None = None) -> tuple[Checkpoint, ShardStore]:
    """Open a Hugging Face style checkpoint directory.

    On any error every descriptor opened so far is closed and nothing is returned,
    so a half-read checkpoint can never be published.
    """
    root = os.path.realpath(model_dir)
    if not os.path.isdir(root):
        raise CheckpointError(model_dir, "is not a directory")
    model_name = name or os.path.basename(root)
    config_raw = _read_small(root, CONFIG_FILE, ConfigError)
    config = parse_config(os.path.join(root, CONFIG_FILE), config_raw)
    store = ShardStore(root)
    try:
        weight_map: dict[str, str] | None
        index_meta: dict[str, Any] | None = None
        if os.path.lexists(os.path.join(root, INDEX_FILE)):
            raw = _read_small(root, INDEX_FILE, IndexFileError)
            weight_map, index_meta = parse_index(root, raw)
            shard_names = sorted(set(weight_map.values()))
        elif os.path.lexists(os.path.join(root, SINGLE_FILE)):
            weight_map = None
            shard_names = [SINGLE_FILE]
        else:
            raise CheckpointError(root, f"has neither {INDEX_FILE} nor {SINGLE_FILE}")
        headers = {shard: read_header(store, shard) for shard in shard_names}
        ckpt = describe(
            model_name,
            root,
            config,
            config_raw.decode("utf-8"),
            weight_map,
            headers,
            index_meta,
        )
    except BaseException:
        store.close()
        raise
    return ckpt, store
