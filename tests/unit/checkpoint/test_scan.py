"""Loading real (tiny) checkpoints (``weightd.server.checkpoint.scan.load_checkpoint``).

Good checkpoints (one file, sharded with an index, symlinked), then directories and
config files that are refused with the error type and file of the rule they break.
The index and the shard files it names are refused in ``test_scan_index.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.tiny_checkpoint import (
    CONFIG,
    SHARD1,
    SHARD2,
    index_doc,
    llama_tensors,
    loaded,
    open_fds,
    split_in_two,
    tbytes,
    write_json,
    write_model,
)
from weightd.server.base.errors import CheckpointError, ConfigSyntaxError, MissingFileError
from weightd.server.checkpoint import scan as checkpoint_scan
from weightd.server.checkpoint.description import INDEX_FILE
from weightd.server.checkpoint.scan import load_checkpoint

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
