"""Loading checkpoints whose index or shard files are wrong: each refused, nothing left open.

Every rule of the index (``weight_map``, file names confined to the model directory,
shard assignment, total size) broken once, and shards that are symlinks out of the
root, dangling, directories or unparseable; each error names the file at fault.
Files that are not what they seem to the loader (FIFOs, symlinked single files and
configs) are in ``test_scan_unsafe_files.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from tests.unit.tiny_checkpoint import (
    SHARD1,
    SHARD2,
    T1,
    T2,
    index_doc,
    llama_tensors,
    open_fds,
    split_in_two,
    write_json,
    write_model,
)
from weightd.server.base.errors import (
    CheckpointError,
    DuplicateTensorError,
    HeaderSyntaxError,
    IndexSchemaError,
    IndexSyntaxError,
    MissingFileError,
    NotRegularFileError,
    PathEscapeError,
    ShardAssignmentError,
    ShardFormatError,
    TotalSizeError,
)
from weightd.server.checkpoint.description import INDEX_FILE
from weightd.server.checkpoint.scan import load_checkpoint

Mutation = Callable[[Path, dict[str, Any]], None]


def _set(tensor: str, value: Any) -> Mutation:
    def mutate(root: Path, doc: dict[str, Any]) -> None:
        doc["weight_map"][tensor] = value

    return mutate


def _doc(fn: Callable[[dict[str, Any]], None]) -> Mutation:
    return lambda root, doc: fn(doc)


def _raw_index(raw: bytes) -> Mutation:
    def mutate(root: Path, doc: dict[str, Any]) -> None:
        doc.clear()
        doc["__raw__"] = raw

    return mutate


def _duplicate_in_second_shard(root: Path, doc: dict[str, Any]) -> None:
    tensors = llama_tensors()
    halves = split_in_two(tensors)
    save_file({**halves[SHARD2], T1: tensors[T1]}, str(root / SHARD2))


def _symlink_outside(root: Path, doc: dict[str, Any]) -> None:
    outside = root.parent / "elsewhere.safetensors"
    os.replace(root / SHARD2, outside)
    os.symlink(outside, root / SHARD2)


def _relative_symlink_outside(root: Path, doc: dict[str, Any]) -> None:
    os.replace(root / SHARD2, root.parent / "up.safetensors")
    os.symlink("../up.safetensors", root / SHARD2)


def _dangling_symlink(root: Path, doc: dict[str, Any]) -> None:
    (root / SHARD2).unlink()
    os.symlink("gone.safetensors", root / SHARD2)


def _directory_shard(root: Path, doc: dict[str, Any]) -> None:
    (root / SHARD2).unlink()
    (root / SHARD2).mkdir()


def _bad_header(root: Path, doc: dict[str, Any]) -> None:
    blob = bytearray((root / SHARD2).read_bytes())
    blob[8] = ord("[")
    (root / SHARD2).write_bytes(bytes(blob))


def _bin_shard(root: Path, doc: dict[str, Any]) -> None:
    (root / "pytorch_model-00001-of-00002.bin").write_bytes(b"\x80\x04pickle")
    doc["weight_map"][T2] = "pytorch_model-00001-of-00002.bin"


INDEX = INDEX_FILE
WM2 = f"weight_map[{T2!r}]"  # how a message names the index entry of T2


def _case(
    id_: str, mutate: Mutation, error: type[CheckpointError], file: str, *needles: str
) -> Any:
    """``file``: the file the error must be about (its ``path``), relative to the root."""
    return pytest.param(mutate, error, file, needles, id=id_)


INDEX_CASES = [
    _case(
        "no-wm",
        _doc(lambda d: d.pop("weight_map")),
        IndexSchemaError,
        INDEX,
        "'weight_map'",
        "is missing",
    ),
    _case(
        "wm-list",
        _doc(lambda d: d.update(weight_map=[T1])),
        IndexSchemaError,
        INDEX,
        "'weight_map'",
        "is a list",
    ),
    _case(
        "wm-empty",
        _doc(lambda d: d.update(weight_map={})),
        IndexSchemaError,
        INDEX,
        "'weight_map' is empty",
    ),
    _case("wm-value-int", _set(T2, 2), IndexSchemaError, INDEX, WM2, "file name string", "got int"),
    _case(
        "metadata-list",
        _doc(lambda d: d.update(metadata=[1])),
        IndexSchemaError,
        INDEX,
        "'metadata'",
        "got list",
    ),
    _case("not-json", _raw_index(b"{"), IndexSyntaxError, INDEX, "not valid JSON"),
    _case("array", _raw_index(b"[]"), IndexSyntaxError, INDEX, "must be a JSON object", "got list"),
    _case(
        "duplicate-key",
        _raw_index(b'{"weight_map": {}, "weight_map": {}}'),
        IndexSyntaxError,
        INDEX,
        "duplicate key 'weight_map'",
    ),
    _case(
        "duplicate-tensor",
        _raw_index(b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}'),
        IndexSyntaxError,
        INDEX,
        "duplicate key 'a' in 'weight_map'",
    ),
    _case(
        "absolute",
        _set(T2, "/etc/passwd.safetensors"),
        PathEscapeError,
        INDEX,
        WM2,
        "'/etc/passwd.safetensors'",
        "absolute",
    ),
    _case(
        "dot-dot-prefix",
        _set(T2, "../" + SHARD2),
        PathEscapeError,
        INDEX,
        WM2,
        repr("../" + SHARD2),
        "normalized",
    ),
    _case(
        "dot-dot-inside",
        _set(T2, "sub/../" + SHARD2),
        PathEscapeError,
        INDEX,
        WM2,
        repr("sub/../" + SHARD2),
        "normalized",
    ),
    _case(
        "dot",
        _set(T2, "./" + SHARD2),
        PathEscapeError,
        INDEX,
        WM2,
        repr("./" + SHARD2),
        "normalized",
    ),
    _case(
        "double-slash",
        _set(T2, "a//" + SHARD2),
        PathEscapeError,
        INDEX,
        WM2,
        repr("a//" + SHARD2),
        "normalized",
    ),
    _case(
        "backslash",
        _set(T2, "sub\\" + SHARD2),
        PathEscapeError,
        INDEX,
        WM2,
        repr("sub\\" + SHARD2),
        "backslash",
    ),
    _case(
        "drive",
        _set(T2, "C:" + SHARD2),
        PathEscapeError,
        INDEX,
        WM2,
        repr("C:" + SHARD2),
        "drive prefix",
    ),
    _case(
        "nul",
        _set(T2, "x\x00.safetensors"),
        PathEscapeError,
        INDEX,
        WM2,
        repr("x\x00.safetensors"),
        "NUL",
    ),
    _case("empty-name", _set(T2, ""), PathEscapeError, INDEX, WM2, "file name is empty"),
    _case(
        "bin-shard",
        _bin_shard,
        ShardFormatError,
        INDEX,
        WM2,
        "'pytorch_model-00001-of-00002.bin'",
        "pickle",
    ),
    _case(
        "missing-shard",
        _set(T2, "model-00003-of-00003.safetensors"),
        MissingFileError,
        "model-00003-of-00003.safetensors",
        "does not exist",
    ),
    _case("wrong-shard", _set(T2, SHARD1), ShardAssignmentError, INDEX, WM2, SHARD1, SHARD2),
    _case(
        "tensor-not-in-index",
        _doc(lambda d: d["weight_map"].pop(T2)),
        ShardAssignmentError,
        INDEX,
        repr(T2),
        SHARD2,
        "missing from weight_map",
    ),
    _case(
        "index-tensor-in-no-shard",
        _set("ghost.weight", SHARD1),
        ShardAssignmentError,
        INDEX,
        "weight_map['ghost.weight']",
        SHARD1,
        "lacks it",
    ),
    _case(
        "tensor-in-two-shards",
        _duplicate_in_second_shard,
        DuplicateTensorError,
        SHARD2,
        repr(T1),
        SHARD1,
        "exactly one shard",
    ),
    _case(
        "total-size-mismatch",
        _doc(lambda d: d["metadata"].update(total_size=12345)),
        TotalSizeError,
        INDEX,
        "metadata.total_size is 12345",
    ),
    _case(
        "total-size-string",
        _doc(lambda d: d["metadata"].update(total_size="100")),
        IndexSchemaError,
        INDEX,
        "'metadata.total_size'",
        "'100'",
    ),
    _case(
        "symlink-out",
        _symlink_outside,
        PathEscapeError,
        SHARD2,
        "elsewhere.safetensors",
        "outside the model directory",
    ),
    _case(
        "relative-symlink-out",
        _relative_symlink_outside,
        PathEscapeError,
        SHARD2,
        "up.safetensors",
        "outside the model directory",
    ),
    _case("dangling", _dangling_symlink, MissingFileError, SHARD2, "does not exist"),
    _case("dir", _directory_shard, NotRegularFileError, SHARD2, "not a regular file", "directory"),
    _case("bad-header", _bad_header, HeaderSyntaxError, SHARD2, "header is not valid JSON"),
]


@pytest.mark.parametrize(("mutate", "error", "file", "needles"), INDEX_CASES)
def test_index_and_shard_errors(
    tmp_path: Path,
    mutate: Mutation,
    error: type[CheckpointError],
    file: str,
    needles: tuple[str, ...],
) -> None:
    shards = split_in_two(llama_tensors())
    root = write_model(tmp_path / "m", shards)
    doc = index_doc(shards)
    mutate(root, doc)
    if "__raw__" in doc:
        (root / INDEX_FILE).write_bytes(doc["__raw__"])
    else:
        write_json(root / INDEX_FILE, doc)
    before = open_fds()
    with pytest.raises(error) as info:
        load_checkpoint(str(root))
    err = info.value
    assert type(err) is error, f"{type(err).__name__}: {err}"
    assert err.path == str(root / file)  # the message names the file at fault
    assert str(err).startswith(err.path + ": ")
    for needle in needles:
        assert needle in err.problem, (needle, str(err))
    assert open_fds() == before  # every descriptor opened before the error is closed
