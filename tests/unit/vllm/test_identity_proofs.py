"""How the vLLM loader proves DIR's shards are the daemon's, without reading them whole.

A fine-tune of the same base (same config, index and shard sizes, other numbers) is
the case that matters: the daemon's sampled digest of its verified shard and the
loader's own of DIR's differ. The same file on the same host and a cache blob named
by the daemon's SHA-256 prove without reading; a daemon that sends nothing leaves the
shard unchecked (the loader then refuses unless told ``identity: warn``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from tests.models import build_model
from weightd.client import FileDigest, ModelDescription
from weightd.common.sampling import header_tensors, sample_ranges
from weightd.server.registry.identity import host_boot_id, shard_samples
from weightd.server.registry.models import load_model
from weightd.vllm.share.identity import compare_files, local_sample

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def _write(directory: Path, seed: int) -> Path:
    build_model("llama", CONFIG, seed=seed).save_pretrained(directory, max_shard_size="60KB")
    return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("identity")
    return _write(root / "base", 0), _write(root / "finetune", 1)


def _described(directory: Path) -> ModelDescription:
    """What the daemon's DescribeModel says of ``directory`` (computed as it does)."""
    model = load_model(str(directory), "m")
    try:
        samples = shard_samples(model)
        files = []
        for name in sorted(model.checkpoint.shards):
            held = model.store.shard(name).identity
            files.append(
                FileDigest(name, held.size, "", held.dev, held.ino, held.mtime_ns, samples[name])
            )
        for name in sorted(model.checkpoint.small_files):
            files.append(
                FileDigest(name, model.file_digests[name].size, model.file_digests[name].sha256)
            )
        return ModelDescription(
            "m",
            "LlamaForCausalLM",
            model.checkpoint.config_json,
            0,
            (),
            tuple(files),
            "",
            host_boot_id(),
        )
    finally:
        model.store.close()


def test_the_daemons_sample_is_the_loaders_for_the_same_file(pair: tuple[Path, Path]) -> None:
    base, _ = pair
    desc = _described(base)
    for f in desc.files:
        if f.name.endswith(".safetensors"):
            assert local_sample(base / f.name) == f.sample_digest


def test_a_fine_tune_of_the_same_shapes_is_told_apart(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    base, finetune = pair
    for name in ("config.json", "model.safetensors.index.json"):
        assert (base / name).read_bytes() == (finetune / name).read_bytes()
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    assert [(base / s).stat().st_size for s in shards] == [
        (finetune / s).stat().st_size for s in shards
    ]
    served = _described(finetune)
    found = compare_files(base, served)
    assert sorted(d.file for d in found.differences) == shards
    assert all("sampled tensor bytes hash to" in str(d) for d in found.differences)
    assert found.proven == {} and found.unchecked == {}


def test_the_same_file_on_this_host_is_proven_without_reading(pair: tuple[Path, Path]) -> None:
    base, _ = pair
    found = compare_files(base, _described(base))
    assert found.differences == [] and found.unchecked == {}
    assert set(found.proven.values()) == {"same file"}


def test_a_copy_is_proven_by_its_samples_and_another_host_too(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    base, _ = pair
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)  # other inodes: not the same file, the same bytes
    served = _described(base)
    assert set(compare_files(copy, served).proven.values()) == {"sampled"}
    elsewhere = dataclasses.replace(served, host_boot_id="another-host")
    assert set(compare_files(base, elsewhere).proven.values()) == {"sampled"}


def test_a_cache_blob_named_by_the_daemons_sha256_proves_it(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    import hashlib

    base, _ = pair
    served = _described(base)
    blobs = tmp_path / "blobs"
    snapshot = tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    files = []
    for f in served.files:
        data = (base / f.name).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        os.symlink(blobs / sha, snapshot / f.name)
        # The daemon hashed whole files (HF cache trust); no sample, no file identity.
        files.append(FileDigest(f.name, f.size, sha))
    blob_desc = dataclasses.replace(served, files=tuple(files), host_boot_id="")
    found = compare_files(snapshot, blob_desc)
    assert found.differences == []
    assert set(found.proven.values()) == {"cache blob"}
    wrong = tuple(
        dataclasses.replace(f, sha256="0" * 64) if f.name.endswith(".safetensors") else f
        for f in files
    )
    found = compare_files(snapshot, dataclasses.replace(blob_desc, files=wrong))
    assert found.differences and all("cache blob sha256" in str(d) for d in found.differences)


def test_a_daemon_that_sends_nothing_leaves_shards_unchecked(pair: tuple[Path, Path]) -> None:
    base, _ = pair
    served = _described(base)
    bare = tuple(
        FileDigest(f.name, f.size, f.sha256 if f.name.endswith(".json") else "")
        for f in served.files
    )
    found = compare_files(base, dataclasses.replace(served, files=bare))
    assert found.differences == [] and found.proven == {}
    assert sorted(found.unchecked) == sorted(p.name for p in base.glob("*.safetensors"))


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"\x00" * 7,
        (10**9).to_bytes(8, "little"),
        (2).to_bytes(8, "little") + b"[]",
        (2).to_bytes(8, "little") + b"{}" + b"x",
        (60_000).to_bytes(8, "little") + b"[" * 60_000,  # nested too deep
    ],
)
def test_a_file_that_is_not_safetensors_is_refused(header: bytes) -> None:
    def read(offset: int, n: int) -> bytes:
        data = header[offset : offset + n]
        if len(data) != n:
            raise ValueError("short")
        return data

    if header.endswith(b"{}x"):
        assert header_tensors(read, len(header)) == []  # an empty but valid header
        return
    with pytest.raises(ValueError):
        header_tensors(read, len(header))


def test_sample_ranges_are_the_edges_of_each_tensor() -> None:
    assert sample_ranges(0) == []
    assert sample_ranges(100) == [(0, 100)]
    assert sample_ranges(8192) == [(0, 8192)]
    assert sample_ranges(10_000) == [(0, 4096), (10_000 - 4096, 4096)]


def test_the_loader_refuses_unproven_shards_unless_the_operator_opts_out(
    pair: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from weightd.vllm.errors import WeightdLoadError
    from weightd.vllm.loader.model_loader import check_identity
    from weightd.vllm.loader.options import parse_options

    base, finetune = pair
    served = _described(base)
    bare = dataclasses.replace(
        served,
        files=tuple(
            FileDigest(f.name, f.size, f.sha256 if f.name.endswith(".json") else "")
            for f in served.files
        ),
    )
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    with pytest.raises(WeightdLoadError, match="cannot prove") as err:
        check_identity(base, bare, parse_options({"target": "unix:///x"}), "here")
    assert all(s in str(err.value) for s in shards) and "identity='warn'" in str(err.value)
    warn = parse_options({"target": "unix:///x", "identity": "warn"})
    with caplog.at_level("WARNING", logger="vllm.weightd"):
        proven = check_identity(base, bare, warn, "here")
    assert sorted(proven) == shards and all(v.startswith("UNCHECKED") for v in proven.values())
    [line] = [r.getMessage() for r in caplog.records if "IDENTITY NOT CHECKED" in r.getMessage()]
    assert all(s in line for s in shards)
    # The opt-out covers what cannot be checked, never what was found to differ.
    with pytest.raises(WeightdLoadError, match="sampled tensor bytes hash to"):
        check_identity(base, _described(finetune), warn, "here")
