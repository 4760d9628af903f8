"""Loading real (tiny) checkpoints, confining their file names, reading and verifying bytes."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from weightd.server.base.errors import (
    CheckpointError,
    ConfigSyntaxError,
    DataIntegrityError,
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
    UnsafePathError,
)
from weightd.server.base.paths import check_relative_name, open_regular_file
from weightd.server.checkpoint import scan as checkpoint_scan
from weightd.server.checkpoint.description import INDEX_FILE, Checkpoint, TensorInfo
from weightd.server.checkpoint.scan import load_checkpoint
from weightd.server.plan.builtin_rules import rules_for
from weightd.server.plan.planner import plan_rank
from weightd.server.store.runs import RunPattern, block_pattern, whole_pattern
from weightd.server.store.shards import MAX_GAP_BYTES, ShardStore
from weightd.server.trust import integrity
from weightd.server.trust.integrity import anchor_slices, hash_checkpoint

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "num_hidden_layers": 1,
    "vocab_size": 64,
}
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def llama_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": rand(64, 16),
        p + "input_layernorm.weight": rand(16),
        p + "self_attn.q_proj.weight": rand(16, 16),
        p + "self_attn.k_proj.weight": rand(8, 16),
        p + "self_attn.v_proj.weight": rand(8, 16),
        p + "self_attn.o_proj.weight": rand(16, 16),
        p + "post_attention_layernorm.weight": torch.randn(16, generator=gen),
        p + "mlp.gate_proj.weight": rand(32, 16),
        p + "mlp.up_proj.weight": rand(32, 16),
        p + "mlp.down_proj.weight": rand(16, 32),
        "model.norm.weight": torch.randn(16, generator=gen),
        "lm_head.weight": rand(64, 16),
    }


def split_in_two(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    names = list(tensors)
    half = len(names) // 2
    return {
        SHARD1: {n: tensors[n] for n in names[:half]},
        SHARD2: {n: tensors[n] for n in names[half:]},
    }


def tbytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))


def index_doc(shards: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    weight_map = {n: shard for shard, ts in shards.items() for n in ts}
    total = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def write_model(
    root: Path,
    shards: dict[str, dict[str, torch.Tensor]],
    *,
    config: dict[str, Any] | None = None,
    index: bool = True,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "config.json", CONFIG if config is None else config)
    for name, ts in shards.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        save_file(ts, str(root / name), metadata={"format": "pt", "shard": name})
    if index:
        write_json(root / INDEX_FILE, index_doc(shards))
    return root


@contextlib.contextmanager
def loaded(root: Path) -> Iterator[tuple[Checkpoint, ShardStore]]:
    ckpt, store = load_checkpoint(str(root))
    try:
        yield ckpt, store
    finally:
        store.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def run_bounded(fn: Callable[[], Any], fifos: list[Path], limit: float = 3.0) -> tuple[bool, Any]:
    """Run ``fn`` in a thread; report whether it was still blocked after ``limit`` seconds.

    A call that blocks on a FIFO never returns by itself, so this is a hang guard, not a
    speed check. A blocked reader is released by opening and closing the write end.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    hung = thread.is_alive()
    if hung:
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(30)
    value = result.get("value")
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], ShardStore):
        value[1].close()
    return hung, result.get("error", value)


# --- load_checkpoint: good checkpoints --------------------------------------------------


def test_load_single_file_checkpoint(tmp_path: Path) -> None:
    tensors = llama_tensors()
    root = write_model(tmp_path / "single", {"model.safetensors": tensors}, index=False)
    blob = (root / "model.safetensors").read_bytes()
    with loaded(root) as (ckpt, store):
        assert ckpt.name == "single"
        assert ckpt.root == str(root.resolve())
        assert ckpt.shards == ("model.safetensors",)
        assert ckpt.config == CONFIG
        assert ckpt.config_json == (root / "config.json").read_text()
        assert ckpt.architecture == "LlamaForCausalLM"
        assert ckpt.metadata == {"format": "pt", "shard": "model.safetensors"}
        assert set(ckpt.tensors) == set(tensors)
        offsets = [t.offset for t in ckpt.tensors.values()]
        assert offsets == sorted(offsets)
        for name, t in ckpt.tensors.items():
            src = tensors[name]
            assert t.shard == "model.safetensors"
            assert t.shape == tuple(src.shape)
            assert t.dtype == {torch.bfloat16: "BF16", torch.float32: "F32"}[src.dtype]
            assert t.nbytes == src.numel() * src.element_size()
            assert blob[t.offset : t.offset + t.nbytes] == tbytes(src)
            assert store.read_exact(t.shard, t.offset, t.nbytes) == tbytes(src)
        assert ckpt.total_bytes == sum(t.nbytes for t in ckpt.tensors.values())
        assert list(store.shards) == ["model.safetensors"]


def test_load_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    tensors = llama_tensors()
    shards = split_in_two(tensors)
    root = write_model(tmp_path / "sharded", shards)
    with loaded(root) as (ckpt, store):
        assert ckpt.shards == (SHARD1, SHARD2)
        order = [(ckpt.shards.index(t.shard), t.offset) for t in ckpt.tensors.values()]
        assert order == sorted(order)
        for name, t in ckpt.tensors.items():
            assert name in shards[t.shard]
            blob = (root / t.shard).read_bytes()
            assert blob[t.offset : t.offset + t.nbytes] == tbytes(tensors[name])
        assert ckpt.total_bytes == index_doc(shards)["metadata"]["total_size"]
        assert sorted(store.shards) == [SHARD1, SHARD2]
    # the explicit name wins over the directory name
    ckpt, store = load_checkpoint(str(root), "served-name")
    store.close()
    assert ckpt.name == "served-name"


def test_index_without_total_size_and_shards_in_subdirectory(tmp_path: Path) -> None:
    tensors = llama_tensors()
    halves = split_in_two(tensors)
    shards = {f"weights/{k}": v for k, v in halves.items()}
    root = write_model(tmp_path / "m", shards, index=False)
    doc = index_doc(shards)
    del doc["metadata"]
    write_json(root / INDEX_FILE, doc)
    with loaded(root) as (ckpt, _):
        assert ckpt.shards == tuple(f"weights/{k}" for k in (SHARD1, SHARD2))
        assert set(ckpt.tensors) == set(tensors)


def test_symlinked_model_dir_and_shard_symlink_inside_root(tmp_path: Path) -> None:
    tensors = llama_tensors()
    root = write_model(tmp_path / "real", {"model.safetensors": tensors}, index=False)
    (root / "blobs").mkdir()
    os.replace(root / "model.safetensors", root / "blobs" / "abc123")
    os.symlink("blobs/abc123", root / "model.safetensors")
    os.symlink(root, tmp_path / "alias")
    with loaded(tmp_path / "alias") as (ckpt, store):
        assert ckpt.root == str(root.resolve())
        assert ckpt.name == "real"
        t = ckpt.tensors["lm_head.weight"]
        assert store.read_exact(t.shard, t.offset, t.nbytes) == tbytes(tensors["lm_head.weight"])


def test_index_wins_over_a_stray_single_file(tmp_path: Path) -> None:
    shards = split_in_two(llama_tensors())
    root = write_model(tmp_path / "m", shards)
    save_file({"other": torch.zeros(2)}, str(root / "model.safetensors"))
    with loaded(root) as (ckpt, _):
        assert ckpt.shards == (SHARD1, SHARD2)
        assert "other" not in ckpt.tensors


# --- load_checkpoint: bad directories, configs and indexes -----------------------------------


def test_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for target in (tmp_path / "file", tmp_path / "missing"):
        with pytest.raises(CheckpointError, match="is not a directory") as info:
            load_checkpoint(str(target))
        assert str(target) in str(info.value)


def test_neither_index_nor_single_file(tmp_path: Path) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    write_json(root / "config.json", CONFIG)
    (root / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(MissingFileError) as info:
        load_checkpoint(str(root))
    err = info.value
    assert type(err) is MissingFileError
    assert err.path == str(root.resolve())
    assert str(err).startswith(err.path + ": ")
    assert INDEX_FILE in err.problem
    assert "model.safetensors" in err.problem.replace(INDEX_FILE, "")


CONFIG_CASES = [
    pytest.param(None, MissingFileError, ["file does not exist"], id="missing"),
    pytest.param(b"{", ConfigSyntaxError, ["not valid JSON"], id="not-json"),
    pytest.param(b"\xff\xfe", ConfigSyntaxError, ["not UTF-8", "byte 0"], id="not-utf8"),
    pytest.param(b"[1]", ConfigSyntaxError, ["must be a JSON object", "got list"], id="array"),
    pytest.param(b'{"a": 1, "a": 2}', ConfigSyntaxError, ["duplicate key 'a'"], id="duplicate-key"),
    pytest.param(b'{"rope_theta": NaN}', ConfigSyntaxError, ["'rope_theta'", "NaN"], id="nan"),
    pytest.param(
        b'{"rope_theta": -Infinity}',
        ConfigSyntaxError,
        ["'rope_theta'", "-Infinity"],
        id="infinity",
    ),
]


@pytest.mark.parametrize(("raw", "error", "needles"), CONFIG_CASES)
def test_bad_config_is_config_error(
    tmp_path: Path, raw: bytes | None, error: type[CheckpointError], needles: list[str]
) -> None:
    """A broken config.json is a ConfigSyntaxError; a missing one a MissingFileError."""
    root = write_model(tmp_path / "m", {"model.safetensors": llama_tensors()}, index=False)
    if raw is None:
        (root / "config.json").unlink()
    else:
        (root / "config.json").write_bytes(raw)
    before = open_fds()
    with pytest.raises(error) as info:
        load_checkpoint(str(root))
    err = info.value
    assert type(err) is error, f"{type(err).__name__}: {err}"
    assert err.path == str(root / "config.json")
    assert str(err).startswith(err.path + ": ")
    for needle in needles:
        assert needle in err.problem, (needle, str(err))
    assert open_fds() == before


def test_json_files_above_the_size_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The size cap has no rule-family type of its own: read_small raises the base class
    # for config.json and the index alike.
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    monkeypatch.setattr(checkpoint_scan, "MAX_JSON_BYTES", 64)
    (root / "config.json").write_text(json.dumps({"pad": "x" * 100}))
    with pytest.raises(CheckpointError, match="64-byte limit") as info:
        load_checkpoint(str(root))
    assert type(info.value) is CheckpointError
    assert info.value.path == str(root / "config.json")
    (root / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="64-byte limit") as info:
        load_checkpoint(str(root))
    assert type(info.value) is CheckpointError
    assert info.value.path == str(root / INDEX_FILE)


Mutation = Callable[[Path, dict[str, Any]], None]
T1 = "model.embed_tokens.weight"  # first tensor: stored in SHARD1
T2 = "lm_head.weight"  # last tensor: stored in SHARD2


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


def test_single_file_symlink_outside_root_is_refused(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", {"model.safetensors": llama_tensors()}, index=False)
    os.replace(root / "model.safetensors", tmp_path / "secret.safetensors")
    os.symlink(tmp_path / "secret.safetensors", root / "model.safetensors")
    with pytest.raises(UnsafePathError, match="outside the model directory") as info:
        load_checkpoint(str(root))
    assert info.value.path == str(root / "model.safetensors")


def test_fifo_shard_is_refused_without_hanging(tmp_path: Path) -> None:
    shards = split_in_two(llama_tensors())
    root = write_model(tmp_path / "m", shards)
    (root / SHARD2).unlink()
    os.mkfifo(root / SHARD2)
    hung, outcome = run_bounded(lambda: load_checkpoint(str(root)), [root / SHARD2])
    assert not hung, "loading a checkpoint whose shard is a FIFO blocked"
    assert isinstance(outcome, UnsafePathError), outcome
    assert outcome.path == str(root / SHARD2)
    assert "not a regular file" in str(outcome)


@pytest.mark.parametrize("which", ["config.json", INDEX_FILE])
def test_fifo_config_or_index_is_refused_without_hanging(tmp_path: Path, which: str) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    (root / which).unlink()
    os.mkfifo(root / which)
    hung, outcome = run_bounded(lambda: load_checkpoint(str(root)), [root / which])
    assert not hung, f"loading a checkpoint whose {which} is a FIFO blocked"
    assert isinstance(outcome, CheckpointError), outcome


def test_config_symlink_outside_root_is_refused(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", {"model.safetensors": llama_tensors()}, index=False)
    secret = tmp_path / "secret.json"
    write_json(secret, {**CONFIG, "api_token": "hunter2"})
    (root / "config.json").unlink()
    os.symlink(secret, root / "config.json")
    hung, outcome = run_bounded(lambda: load_checkpoint(str(root)), [])
    assert not hung
    assert isinstance(outcome, UnsafePathError), outcome


# --- paths --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["model.safetensors", "sub/dir/x.safetensors", "a..b.safetensors", "...safetensors"]
)
def test_check_relative_name_accepts_plain_names(name: str) -> None:
    check_relative_name("/models/m", name, what="weight_map['t']")


def test_open_regular_file_returns_an_open_descriptor(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(b"abcdef")
    fd, st = open_regular_file(str(tmp_path), "f.bin")
    try:
        assert st.st_size == 6
        assert os.pread(fd, 3, 2) == b"cde"
        assert os.get_blocking(fd)
    finally:
        os.close(fd)


# --- ShardStore reads ------------------------------------------------------------------------


@pytest.fixture
def raw_file(tmp_path: Path) -> Iterator[Callable[[int], tuple[ShardStore, bytes]]]:
    stores: list[ShardStore] = []

    def make(size: int) -> tuple[ShardStore, bytes]:
        data = np.random.default_rng(size).bytes(size)
        (tmp_path / "data.bin").write_bytes(data)
        store = ShardStore(str(tmp_path))
        store.open("data.bin")
        stores.append(store)
        return store, data

    yield make
    for s in stores:
        s.close()


BASE = 4096 + 7  # an odd offset, so nothing lines up by accident
PATTERN_CASES = [
    # rows, cols, dim, blocks
    pytest.param(64, 1024, 1, [(256, 512)], id="small-gap"),
    pytest.param(6, MAX_GAP_BYTES + 100, 1, [(0, 100)], id="gap-at-limit"),
    pytest.param(6, MAX_GAP_BYTES + 101, 1, [(0, 100)], id="gap-over-limit"),
    pytest.param(5, 300_000, 1, [(1000, 3000)], id="large-gap"),
    pytest.param(32, 512, 1, [(0, 16), (100, 116), (500, 512)], id="three-segments"),
    pytest.param(3000, 8, 1, [(2, 4)], id="many-rows"),
    pytest.param(64, 64, 0, [(16, 32)], id="column"),
    pytest.param(64, 64, 1, [(0, 64)], id="all-rows-whole"),
]
MAX_BYTES = [1, 3, 64, 1000, 4096, 1 << 20]


def numpy_slice(a: np.ndarray, dim: int, blocks: list[tuple[int, int]]) -> bytes:
    return np.concatenate([a.take(range(s, e), axis=dim) for s, e in blocks], axis=dim).tobytes()


@pytest.mark.parametrize("max_bytes", MAX_BYTES)
@pytest.mark.parametrize(("rows", "cols", "dim", "blocks"), PATTERN_CASES)
def test_iter_pattern_equals_numpy_slicing(
    raw_file: Callable[[int], tuple[ShardStore, bytes]],
    rows: int,
    cols: int,
    dim: int,
    blocks: list[tuple[int, int]],
    max_bytes: int,
) -> None:
    store, data = raw_file(BASE + rows * cols + 50)
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    pattern = block_pattern(BASE, a.shape, 8, dim, blocks)
    pieces = list(store.iter_pattern("data.bin", pattern, max_bytes))
    assert b"".join(pieces) == numpy_slice(a, dim, blocks)
    assert all(0 < len(p) <= max_bytes for p in pieces)


@pytest.mark.parametrize("max_bytes", [2, 1000, 1 << 20])
def test_iter_pattern_multi_byte_elements(
    raw_file: Callable[[int], tuple[ShardStore, bytes]], max_bytes: int
) -> None:
    store, data = raw_file(BASE + 48 * 40 * 2 + 10)
    a = np.frombuffer(data, np.uint16, 48 * 40, BASE).reshape(48, 40)
    for rank in range(4):
        pattern = block_pattern(BASE, a.shape, 16, 1, [(rank * 10, rank * 10 + 10)])
        got = b"".join(store.iter_pattern("data.bin", pattern, max_bytes))
        assert got == a[:, rank * 10 : rank * 10 + 10].tobytes()


class PreadvSpy:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (number of buffers, offset)
        self.real = os.preadv

    def __call__(self, fd: int, buffers: list[Any], offset: int, *rest: Any) -> int:
        self.calls.append((len(buffers), offset))
        return self.real(fd, buffers, offset, *rest)


@pytest.fixture
def preadv_spy(monkeypatch: pytest.MonkeyPatch) -> PreadvSpy:
    spy = PreadvSpy()
    monkeypatch.setattr(os, "preadv", spy)
    return spy


def test_small_gaps_are_read_through_scratch_in_one_call(
    raw_file: Callable[[int], tuple[ShardStore, bytes]], preadv_spy: PreadvSpy
) -> None:
    rows, cols, gap = 6, MAX_GAP_BYTES + 100, MAX_GAP_BYTES
    store, data = raw_file(BASE + rows * cols)
    pattern = block_pattern(BASE, (rows, cols), 8, 1, [(0, 100)])
    (piece,) = list(store.iter_pattern("data.bin", pattern, 1 << 20))
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    assert piece == a[:, :100].tobytes()
    assert cols - 100 == gap
    # one preadv: 6 wanted runs and the 5 gaps between them
    assert preadv_spy.calls == [(2 * rows - 1, BASE)]


def test_large_gaps_are_separate_reads(
    raw_file: Callable[[int], tuple[ShardStore, bytes]], preadv_spy: PreadvSpy
) -> None:
    rows, cols = 6, MAX_GAP_BYTES + 101
    store, data = raw_file(BASE + rows * cols)
    pattern = block_pattern(BASE, (rows, cols), 8, 1, [(0, 100)])
    (piece,) = list(store.iter_pattern("data.bin", pattern, 1 << 20))
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    assert piece == a[:, :100].tobytes()
    assert preadv_spy.calls == [(1, BASE + i * cols) for i in range(rows)]


def test_many_rows_split_preadv_at_the_iov_limit(
    raw_file: Callable[[int], tuple[ShardStore, bytes]], preadv_spy: PreadvSpy
) -> None:
    rows, cols = 3000, 8
    store, data = raw_file(BASE + rows * cols)
    pattern = block_pattern(BASE, (rows, cols), 8, 1, [(2, 4)])
    (piece,) = list(store.iter_pattern("data.bin", pattern, 1 << 20))
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    assert piece == a[:, 2:4].tobytes()
    assert len(preadv_spy.calls) > 1
    assert all(n <= 1024 for n, _ in preadv_spy.calls)


def test_iter_pattern_of_count_one_is_chunked(
    raw_file: Callable[[int], tuple[ShardStore, bytes]],
) -> None:
    store, data = raw_file(10_000)
    pieces = list(store.iter_pattern("data.bin", whole_pattern(100, 9_000), 4096))
    assert [len(p) for p in pieces] == [4096, 4096, 808]
    assert b"".join(pieces) == data[100:9_100]


# --- ShardStore: files changing under the daemon -----------------------------------------------


def _model_with_old_mtime(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint whose shards' mtimes are in the past.

    File timestamps may be coarse (a clock tick), so a rewrite right after creation can
    leave ctime/mtime unchanged; moving mtime back first makes any later write visible.
    """
    tensors = llama_tensors()
    root = write_model(tmp_path / "m", split_in_two(tensors))
    for shard in (SHARD1, SHARD2):
        os.utime(root / shard, ns=(1_000_000_000, 1_000_000_000))
    return root, tensors


def _row_pattern(t: TensorInfo) -> RunPattern:
    return block_pattern(t.offset, t.shape, 16, 1, [(0, t.shape[1] // 2)])


@pytest.mark.parametrize("kind", ["whole", "rows"])
@pytest.mark.parametrize("cut", ["inside-tensor", "at-tensor-start", "empty-file"])
def test_truncated_shard_raises_data_integrity_error(tmp_path: Path, kind: str, cut: str) -> None:
    root, _ = _model_with_old_mtime(tmp_path)
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[T2]  # BF16 [64, 16] in SHARD2
        sizes = {"inside-tensor": t.offset + t.nbytes // 2, "at-tensor-start": t.offset}
        size = sizes.get(cut, 0)
        os.truncate(root / t.shard, size)
        pattern = whole_pattern(t.offset, t.nbytes) if kind == "whole" else _row_pattern(t)
        got: list[bytes] = []
        with pytest.raises(DataIntegrityError) as info:
            got.extend(store.iter_pattern(t.shard, pattern, 256))
        assert got == []  # no piece is handed out once the file changed
        assert str(root / t.shard) in str(info.value)
        with pytest.raises(DataIntegrityError, match="short read"):
            store.read_exact(t.shard, t.offset, t.nbytes)
        with pytest.raises(DataIntegrityError, match=f"size changed from .* to {size} bytes"):
            store.check(t.shard)


def test_truncation_after_the_tensor_is_caught_by_the_identity_check(tmp_path: Path) -> None:
    root, tensors = _model_with_old_mtime(tmp_path)
    with loaded(root) as (ckpt, store):
        first = min((t for t in ckpt.tensors.values() if t.shard == SHARD2), key=lambda t: t.offset)
        os.truncate(root / SHARD2, first.offset + first.nbytes)
        # the bytes are still there, but the file is not the one that was verified
        assert store.read_exact(SHARD2, first.offset, first.nbytes) == tbytes(tensors[first.name])
        with pytest.raises(DataIntegrityError, match="size changed"):
            list(store.iter_pattern(SHARD2, whole_pattern(first.offset, first.nbytes), 1 << 20))


def test_shard_rewritten_in_place_is_detected(tmp_path: Path) -> None:
    root, tensors = _model_with_old_mtime(tmp_path)
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[T2]
        store.check(t.shard)  # unchanged so far
        size = (root / t.shard).stat().st_size
        with open(root / t.shard, "r+b") as f:
            f.seek(t.offset)
            f.write(bytes(b ^ 0xFF for b in tbytes(tensors[T2])[:32]))
        assert (root / t.shard).stat().st_size == size
        with pytest.raises(DataIntegrityError, match="modified in place") as info:
            store.check(t.shard)
        assert str(root / t.shard) in str(info.value)
        got: list[bytes] = []
        with pytest.raises(DataIntegrityError):
            got.extend(store.iter_pattern(t.shard, whole_pattern(t.offset, t.nbytes), 1 << 20))
        assert got == []
        store.check(SHARD1)  # the other shard is untouched


def test_shard_replaced_by_rename_still_reads_old_bytes(tmp_path: Path) -> None:
    root, tensors = _model_with_old_mtime(tmp_path)
    shards = split_in_two(llama_tensors(seed=99))
    with loaded(root) as (ckpt, store):
        replacement = tmp_path / "new.safetensors"
        save_file(shards[SHARD2], str(replacement))
        os.replace(replacement, root / SHARD2)
        t = ckpt.tensors[T2]
        assert store.read_exact(t.shard, t.offset, t.nbytes) == tbytes(tensors[T2])
        buf = bytearray(t.nbytes)
        store.read_into(t.shard, t.offset, memoryview(buf))
        assert bytes(buf) == tbytes(tensors[T2])
    with loaded(root) as (ckpt2, store2):
        t2 = ckpt2.tensors[T2]
        assert store2.read_exact(t2.shard, t2.offset, t2.nbytes) == tbytes(shards[SHARD2][T2])


def _wait_for_coarse_clock_past(ns: int) -> None:
    """Wait until the kernel's coarse clock (what inode timestamps use) is past ``ns``.

    Then any later inode change gets a later ctime, whatever the timestamp granularity.
    """
    clock = getattr(time, "CLOCK_REALTIME_COARSE", 5)  # 5 on Linux
    while time.clock_gettime_ns(clock) <= ns:
        time.sleep(0.001)


def test_shard_replaced_by_rename_keeps_serving(tmp_path: Path) -> None:
    root, tensors = _model_with_old_mtime(tmp_path)
    shards = split_in_two(llama_tensors(seed=99))
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[T2]
        replacement = tmp_path / "new.safetensors"
        save_file(shards[SHARD2], str(replacement))
        _wait_for_coarse_clock_past(store.shard(t.shard).identity.ctime_ns)
        os.replace(replacement, root / SHARD2)
        store.check(t.shard)
        got = b"".join(store.iter_pattern(t.shard, _row_pattern(t), 100))
        assert got == tbytes(tensors[T2][:, :8])
        digests = hash_checkpoint(ckpt, store)
        assert digests[T2] == _b3(tbytes(tensors[T2]))


def test_close_is_idempotent(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    before = open_fds()
    _, store = load_checkpoint(str(root))
    assert open_fds() == before + 2
    store.close()
    store.close()
    assert open_fds() == before


# --- integrity ---------------------------------------------------------------------------------


def _b3(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("block", [None, 5, 1000])
@pytest.mark.parametrize("threads", [None, 1, 3])
def test_hash_checkpoint_is_blake3_of_each_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int | None, threads: int | None
) -> None:
    tensors = llama_tensors()
    tensors["empty"] = torch.zeros(0, 4)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    shards = split_in_two(tensors)
    root = write_model(tmp_path / "m", shards)
    if block is not None:
        monkeypatch.setattr(integrity, "BLOCK_BYTES", block)
    with loaded(root) as (ckpt, store):
        digests = hash_checkpoint(ckpt, store, threads)
    assert digests == {name: _b3(tbytes(t)) for name, t in tensors.items()}
    assert digests["empty"] == _b3(b"")


def test_hash_checkpoint_of_a_truncated_shard_raises(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    with loaded(root) as (ckpt, store):
        os.truncate(root / SHARD1, 100)
        with pytest.raises(DataIntegrityError, match=SHARD1):
            hash_checkpoint(ckpt, store)


def expected_rank_bytes(t: torch.Tensor, split: str, ws: int, rank: int, kv: int = 2) -> bytes:
    if split == "replicated":
        return tbytes(t)
    if split == "kv" and ws > kv:
        hd = t.shape[0] // kv
        return tbytes(t[(rank // (ws // kv)) * hd :][:hd])
    dim = 1 if split == "row" else 0
    n = t.shape[dim] // ws
    return tbytes(t.narrow(dim, rank * n, n))


ANCHOR_CASES = [
    ("model.layers.0.self_attn.o_proj.weight", "row"),
    ("model.layers.0.mlp.down_proj.weight", "row"),
    ("model.layers.0.self_attn.q_proj.weight", "column"),
    ("model.layers.0.self_attn.k_proj.weight", "kv"),
    ("model.embed_tokens.weight", "column"),
    ("lm_head.weight", "column"),
    ("model.norm.weight", "replicated"),
]


@pytest.mark.parametrize("block", [None, 7, 100])
@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize(("name", "split"), ANCHOR_CASES, ids=[c[0] for c in ANCHOR_CASES])
def test_anchor_slices_are_sha256_of_each_rank_slice(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    split: str,
    ws: int,
    block: int | None,
) -> None:
    tensors = llama_tensors()
    root = write_model(tmp_path / "m", split_in_two(tensors))
    if block is not None:
        monkeypatch.setattr(integrity, "BLOCK_BYTES", block)
    rules = rules_for(CONFIG)
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[name]
        patterns = [plan_rank(ckpt, rules, ws, r, (name,)).slices[0].pattern for r in range(ws)]
        if split == "row" and ws > 1:
            assert all(p.count > 1 for p in patterns)  # the row-pattern branch
        else:
            assert all(p.count == 1 for p in patterns)
        got = anchor_slices(store, t, _b3(tbytes(tensors[name])), patterns)
    want_split = "replicated" if ws == 1 else split
    assert got == [_sha(expected_rank_bytes(tensors[name], want_split, ws, r)) for r in range(ws)]


def test_anchor_slices_mixed_patterns_and_fused_blocks(tmp_path: Path) -> None:
    tensors = llama_tensors()
    root = write_model(tmp_path / "m", split_in_two(tensors))
    name = "model.layers.0.mlp.gate_proj.weight"  # BF16 [32, 16]
    src = tensors[name]
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[name]
        patterns = [
            whole_pattern(t.offset, t.nbytes),
            block_pattern(t.offset, t.shape, 16, 0, [(0, 4), (16, 20)]),
            block_pattern(t.offset, t.shape, 16, 0, [(31, 32)]),
        ]
        got = anchor_slices(store, t, _b3(tbytes(src)), patterns)
    assert got == [
        _sha(tbytes(src)),
        _sha(tbytes(torch.cat([src[0:4], src[16:20]]))),
        _sha(tbytes(src[31:32])),
    ]


@pytest.mark.parametrize("name", [T2, "model.layers.0.self_attn.o_proj.weight"])
def test_anchor_slices_refuse_bytes_that_no_longer_match(tmp_path: Path, name: str) -> None:
    """The file changed between verification and the first fetch of a tensor."""
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    with loaded(root) as (ckpt, store):
        verified = hash_checkpoint(ckpt, store)
    t = ckpt.tensors[name]
    with open(root / t.shard, "r+b") as f:
        f.seek(t.offset + 3)
        byte = f.read(1)[0]
        f.seek(t.offset + 3)
        f.write(bytes([byte ^ 0x5A]))
    rules = rules_for(CONFIG)
    with loaded(root) as (ckpt2, store2):
        t2 = ckpt2.tensors[name]
        assert t2 == t
        patterns = [plan_rank(ckpt2, rules, 2, r, (name,)).slices[0].pattern for r in range(2)]
        with pytest.raises(DataIntegrityError) as info:
            anchor_slices(store2, t2, verified[name], patterns)
    msg = str(info.value)
    assert repr(name) in msg
    assert t.shard in msg
    assert verified[name] in msg


def test_anchor_slices_with_a_wrong_digest(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors["model.norm.weight"]
        with pytest.raises(DataIntegrityError, match="verified digest is blake3:00"):
            anchor_slices(store, t, "blake3:" + "00" * 32, [whole_pattern(t.offset, t.nbytes)])


def test_anchor_slices_reject_inconsistent_row_patterns(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors["model.layers.0.self_attn.o_proj.weight"]  # BF16 [16, 16]
        digest = hash_checkpoint(ckpt, store)[t.name]
        p0 = block_pattern(t.offset, t.shape, 16, 1, [(0, 8)])
        # A peer with a different row stride cannot be a cut of the same grid of rows.
        other_stride = RunPattern(t.offset, p0.stride // 2, p0.count * 2, ((0, 8),))
        with pytest.raises(DataIntegrityError, match="disagree on row layout"):
            anchor_slices(store, t, digest, [p0, other_stride])
        # Rows may start later (stacked experts), but never off a row boundary or past
        # the end of the tensor.
        off_row = RunPattern(t.offset + 2, p0.stride, p0.count - 1, p0.segments)
        with pytest.raises(DataIntegrityError, match="disagree on row layout"):
            anchor_slices(store, t, digest, [off_row])
        past_end = RunPattern(t.offset + p0.stride, p0.stride, p0.count, p0.segments)
        with pytest.raises(DataIntegrityError, match="disagree on row layout"):
            anchor_slices(store, t, digest, [past_end])
