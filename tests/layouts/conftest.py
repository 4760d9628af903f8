"""Fixtures for the layout tests: every built-in architecture, quantized checkpoints, and
one daemon (out of process) serving them all."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon
from tests.layouts import hf


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return hf.write_models(tmp_path_factory.mktemp("archs"))


@pytest.fixture(scope="session")
def quant_models(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]]:
    root = tmp_path_factory.mktemp("quant")
    return {kind: hf.write_quantized(root, kind) for kind in hf.QUANT_CONFIGS}


@pytest.fixture(scope="session")
def stacked_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint in transformers 5's in-memory MoE layout (experts stacked on dim 0)."""
    from safetensors.torch import save_file

    from tests.layouts.fakes import fake_checkpoint
    from tests.layouts.specs import VARIANTS

    config, specs = VARIANTS["stacked-experts"]
    fake = fake_checkpoint(config, specs, shards=1, seed=3)
    directory = tmp_path_factory.mktemp("stacked")
    (directory / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in fake.tensors.items()}, str(directory / "model.safetensors")
    )
    return directory


@pytest.fixture(scope="session")
def layout_daemon(
    arch_models: dict[str, Path],
    quant_models: dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]],
    stacked_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningDaemon]:
    models = sorted(arch_models.items()) + [(f"quant-{k}", d) for k, (d, _) in quant_models.items()]
    models.append(("stacked-experts", stacked_model))
    tmp = tmp_path_factory.mktemp("layout-daemon")
    # Small chunks: multi-chunk slices and shared messages are both exercised.
    with run_daemon(tmp, models, ["--chunk-bytes", "8192"]) as daemon:
        yield daemon
