"""Bad adapters are refused precisely, and leave the adapters already loaded untouched.

Each case starts from a copy of a real PEFT adapter and breaks one thing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.adapters.conftest import Fixture
from weightd.server.adapters.load import load_adapter
from weightd.server.adapters.registry import AdapterRegistry
from weightd.server.base.errors import (
    AdapterBaseMismatch,
    AdapterConfigError,
    AdapterDtypeError,
    AdapterFormatError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterTensorError,
    DigestMismatchError,
    DuplicateKeyError,
    MissingFileError,
    OutsideRootError,
    PathEscapeError,
    RequestPathError,
    UnsupportedAdapterFeature,
)
from weightd.server.checkpoint.description import Checkpoint
from weightd.server.checkpoint.scan import load_checkpoint

Q = "base_model.model.model.layers.0.self_attn.q_proj"


def edit_config(**changes: Any) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        p = d / "adapter_config.json"
        doc = json.loads(p.read_text())
        for k, v in changes.items():
            if v is ...:
                del doc[k]
            else:
                doc[k] = v
        p.write_text(json.dumps(doc))

    return go


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def go(d: Path) -> None:
        p = d / "adapter_model.safetensors"
        tensors = load_file(str(p))
        change(tensors)
        save_file(tensors, str(p))

    return go


def pickled(d: Path) -> None:
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.bin").write_bytes(b"\x80\x04K\x01.")  # never opened


def duplicate_header_key(d: Path) -> None:
    p = d / "adapter_model.safetensors"
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].decode()
    first = header.index('"base_model')
    entry_end = header.index("}", first) + 1
    dup = header[first:entry_end]
    new = header[:-1] + "," + dup + "}"
    new = new + " " * (-(len(new)) % 8)
    p.write_bytes(len(new).to_bytes(8, "little") + new.encode() + data[8 + n :])


def _wrong_shape(t: dict[str, torch.Tensor]) -> None:
    t[f"{Q}.lora_B.weight"] = torch.randn(60, 4)


def _wrong_r_pair(t: dict[str, torch.Tensor]) -> None:
    t[f"{Q}.lora_A.weight"] = torch.randn(3, 64)
    t[f"{Q}.lora_B.weight"] = torch.randn(64, 3)


def _missing_module(t: dict[str, torch.Tensor]) -> None:
    t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.randn(4, 64)
    t["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.randn(64, 4)


def _f64(t: dict[str, torch.Tensor]) -> None:
    t[f"{Q}.lora_A.weight"] = t[f"{Q}.lora_A.weight"].double()


def _half_pair(t: dict[str, torch.Tensor]) -> None:
    del t[f"{Q}.lora_B.weight"]


def _not_lora(t: dict[str, torch.Tensor]) -> None:
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(4, 128)


def _untargeted(t: dict[str, torch.Tensor]) -> None:
    t["base_model.model.lm_head.lora_A.weight"] = torch.randn(4, 64)
    t["base_model.model.lm_head.lora_B.weight"] = torch.randn(128, 4)


CASES: list[tuple[str, Callable[[Path], None], type[Exception], str]] = [
    ("wrong-shape", edit_tensors(_wrong_shape), AdapterShapeError,
     "lora_B.weight': expected shape [64, 4] (r=4, base 'model.layers.0.self_attn.q_proj.weight' "
     "is [64, 64]), got [60, 4]"),
    ("wrong-r", edit_config(r=8), AdapterShapeError, "expected shape [8, 64] (r=8"),
    ("wrong-r-tensors", edit_tensors(_wrong_r_pair), AdapterShapeError, "got [3, 64]"),
    ("r-zero", edit_config(r=0), AdapterConfigError, "field 'r' must be in 1..65536, got 0"),
    ("r-negative", edit_config(r=-1), AdapterConfigError, "got -1"),
    ("missing-target", edit_tensors(_missing_module), AdapterTargetError,
     "target module 'model.layers.7.self_attn.q_proj': the base model 'tiny-llama' has no "
     "tensor 'model.layers.7.self_attn.q_proj.weight'"),
    ("untargeted", edit_tensors(_untargeted), AdapterTargetError,
     "module 'lm_head' has LoRA weights but is not in target_modules"),
    ("pickle", pickled, AdapterFormatError, "pickle weights are never loaded"),
    ("missing-r", edit_config(r=...), AdapterConfigError, "missing field 'r'"),
    ("missing-targets", edit_config(target_modules=...), AdapterConfigError,
     "missing field 'target_modules'"),
    ("dora", edit_config(use_dora=True), UnsupportedAdapterFeature, "DoRA"),
    ("modules-to-save", edit_config(modules_to_save=["lm_head"]), UnsupportedAdapterFeature,
     "modules_to_save"),
    ("bias", edit_config(bias="all"), UnsupportedAdapterFeature, "trained biases"),
    ("f64", edit_tensors(_f64), AdapterDtypeError,
     "lora_A.weight' has dtype F64; adapters must be one of BF16, F16, F32"),
    ("half-pair", edit_tensors(_half_pair), AdapterTensorError, "but no lora_B weight"),
    ("not-lora", edit_tensors(_not_lora), AdapterTensorError, "is not a LoRA weight"),
    ("base-mismatch", edit_config(base_model_name_or_path="meta-llama/Llama-3.1-8B"),
     AdapterBaseMismatch, "names base model 'meta-llama/Llama-3.1-8B', but it is being loaded "
     "on model 'tiny-llama'"),
    ("base-with-nul", edit_config(base_model_name_or_path="/models/tiny\x00llama"),
     AdapterBaseMismatch, "names base model '/models/tiny\\x00llama'"),
    ("duplicate-key", duplicate_header_key, DuplicateKeyError, "duplicate tensor"),
    ("no-config", lambda d: (d / "adapter_config.json").unlink(), MissingFileError,
     "adapter_config.json: file does not exist"),
]  # fmt: skip


@pytest.fixture(scope="module")
def base(lora: Fixture) -> Iterator[Checkpoint]:
    ckpt, store = load_checkpoint(str(lora.base_dir), "tiny-llama")
    store.close()
    yield ckpt


@pytest.fixture(scope="module")
def registry(lora: Fixture, base: Checkpoint) -> AdapterRegistry:
    reg = AdapterRegistry()
    src = str(lora.adapter_dir)
    reg.load("good", src, None, lambda: load_adapter(src, [str(lora.root)], base))
    return reg


def attempt(reg: AdapterRegistry, lora: Fixture, base: Checkpoint, source: str, **kw: Any) -> None:
    """Try the bad source both as a new adapter and as a replace of the loaded one."""
    before = reg.current()
    roots = [str(lora.root)]
    errors = []
    for name in ("fresh", "good"):
        with pytest.raises(Exception) as info:
            reg.load(name, source, None, lambda: load_adapter(source, roots, base, **kw))
        assert reg.current() == before  # nothing published, nothing replaced
        errors.append(info.value)
    assert str(errors[0]) == str(errors[1])
    raise errors[1]


@pytest.mark.parametrize(("label", "breaks", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_adapter_rejected(
    lora: Fixture,
    base: Checkpoint,
    registry: AdapterRegistry,
    tmp_path: Path,
    label: str,
    breaks: Callable[[Path], None],
    error: type[Exception],
    message: str,
) -> None:
    d = lora.root / f"bad-{label}"
    shutil.copytree(lora.adapter_dir, d)
    breaks(d)
    with pytest.raises(error) as info:
        attempt(registry, lora, base, str(d))
    assert type(info.value) is error
    assert message in str(info.value), str(info.value)
    assert str(info.value).startswith(str(d)), str(info.value)  # names the file at fault
    assert [v.name for v, _, _ in registry.current()] == ["good"]
    assert registry.stats()[:2] == (1, 0)


def test_outside_roots(lora: Fixture, base: Checkpoint, registry: AdapterRegistry) -> None:
    with pytest.raises(PathEscapeError, match="outside the adapter roots"):
        attempt(registry, lora, base, str(lora.base_dir))
    with pytest.raises(RequestPathError, match=r"has a '\.\.' component"):
        attempt(registry, lora, base, str(lora.root / ".." / "tiny-llama"))


def test_symlink_escapes(
    lora: Fixture, base: Checkpoint, registry: AdapterRegistry, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(lora.adapter_dir, outside)
    link = lora.root / "linked-dir"
    os.symlink(outside, link)
    with pytest.raises(OutsideRootError, match="outside the adapter root"):
        attempt(registry, lora, base, str(link))
    d = lora.root / "linked-file"
    d.mkdir()
    shutil.copy(lora.adapter_dir / "adapter_config.json", d)
    os.symlink(outside / "adapter_model.safetensors", d / "adapter_model.safetensors")
    with pytest.raises(OutsideRootError, match="outside the adapter root"):
        attempt(registry, lora, base, str(d))


def test_source_dir_relative_to_a_root_and_through_a_link_inside(
    lora: Fixture, base: Checkpoint, tmp_path: Path
) -> None:
    """A name relative to an adapter root is looked up below each root in turn; a link
    that stays inside the root is followed (by descriptor) and reported resolved."""
    other_root = tmp_path / "empty-root"
    other_root.mkdir()
    roots = [str(other_root), str(lora.root)]
    relative = load_adapter("good", roots, base)
    assert relative.source == str(lora.adapter_dir.resolve())
    link = lora.root / "current"
    link.symlink_to("good")
    try:
        linked = load_adapter(str(link), roots, base)
    finally:
        link.unlink()
    assert linked.source == relative.source and linked.digest == relative.digest
    with pytest.raises(MissingFileError, match="adapter directory does not exist"):
        load_adapter("absent", roots, base)


def test_digest_mismatch(lora: Fixture, base: Checkpoint, registry: AdapterRegistry) -> None:
    with pytest.raises(DigestMismatchError, match="adapter digest: expected sha256:00"):
        attempt(registry, lora, base, str(lora.second_dir), expected_digest="sha256:" + "0" * 64)
    good = registry.current()[0][0].adapter.digest
    with pytest.raises(DigestMismatchError, match=f"got {good}"):
        attempt(registry, lora, base, str(lora.adapter_dir), expected_digest="sha256:" + "1" * 64)
