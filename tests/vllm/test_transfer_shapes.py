"""The weight-transfer backend's shape check (``weightd.vllm.transfer.shapes``), without vLLM.

What the engine was built from (its model directory's headers, or its config.json when
it has no safetensors) against a version's description, for the changes that must be
refused before any rank loads a byte and the ones that must not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.models import VERSIONED_LLAMA, build_model
from weightd.client import ModelDescription, TensorInfo
from weightd.vllm.transfer.shapes import differences, directory_signature, header_signature

CONFIG = VERSIONED_LLAMA


def description(directory: Path) -> ModelDescription:
    """What the daemon would describe for ``directory`` (names, dtypes, shapes, config)."""
    signature = directory_signature(directory)
    assert signature is not None
    config = (directory / "config.json").read_text()
    return ModelDescription(
        name="m",
        architecture=json.loads(config)["architectures"][0],
        config_json=config,
        total_bytes=0,
        tensors=tuple(
            TensorInfo(name, dtype, shape, "", 0, "") for name, (dtype, shape) in signature.items()
        ),
    )


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch

    root = tmp_path_factory.mktemp("shapes")
    out = {}
    for name, seed, extra, dtype in (
        ("v1", 1, {}, torch.bfloat16),
        ("v2", 2, {}, torch.bfloat16),
        ("wide", 3, {"intermediate_size": 192}, torch.bfloat16),
        ("fp32", 4, {}, torch.float32),
        ("deeper", 5, {"num_hidden_layers": 3}, torch.bfloat16),
    ):
        build_model("llama", {**CONFIG, **extra}, seed=seed).to(dtype).save_pretrained(root / name)
        out[name] = root / name
    config_only = root / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((root / "v1" / "config.json").read_text())
    out["config-only"] = config_only
    return out


@pytest.mark.parametrize(
    ("engine", "version", "expect"),
    [
        ("v1", "v2", []),  # other weights, same shapes: an update
        ("v1", "wide", ["mlp.down_proj.weight: ('BF16', (64, 128)) in the engine's"]),
        ("v1", "fp32", ["('BF16', (64,)) in the engine's checkpoint, ('F32', (64,))"]),
        ("v1", "deeper", ["model.layers.2.", "not in the engine's checkpoint"]),
        ("config-only", "v2", []),
        ("config-only", "wide", ["config intermediate_size: 128 in the engine, 192 in the"]),
        ("config-only", "deeper", ["config num_hidden_layers: 2 in the engine, 3"]),
    ],
)
def test_differences(dirs: dict[str, Path], engine: str, version: str, expect: list[str]) -> None:
    found = differences(dirs[engine], description(dirs[version]))
    if not expect:
        assert found == []
        return
    text = "; ".join(found)
    for fragment in expect:
        assert fragment in text


def test_differences_are_bounded(dirs: dict[str, Path]) -> None:
    found = differences(dirs["v1"], description(dirs["deeper"]), limit=2)
    assert len(found) == 3 and found[-1].startswith("... and ")


def test_a_hostile_header_length_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="not plausible"):
        header_signature(bad)
