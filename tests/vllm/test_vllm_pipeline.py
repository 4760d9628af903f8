"""Pipeline parallelism in the real vLLM engine: each stage loads only its layers.

vLLM's CPU build (0.32.0) starts a ``pipeline_parallel_size=2`` engine and loads it,
but its stage workers fail the first forward pass whatever the loader (its default
loader too: ``AssertionError`` in ``gpu_model_runner.py``'s
``sync_and_gather_intermediate_tensors``). So these engines generate nothing; what
is compared is what loading put in each stage: every parameter of every stage
bit-identical to vLLM's default loader's, and each stage received exactly its own
layers from weightd (the layout read from vLLM's parallel state, its layer split sent
as ``pp_layers``). Llama: untied head (the last stage's); Qwen2: tied embeddings (the
last stage's head is the embedding's bytes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from tests.conftest import RunningDaemon

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

PP = 2
ENGINE_RUN = Path(__file__).with_name("engine_run.py")


def _checkpoint_names(directory: Path) -> set[str]:
    names: set[str] = set()
    for shard in directory.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            names.update(f.keys())
    return names


def _run(
    vllm_python: Path, directory: Path, daemon: RunningDaemon, model: str, out: Path
) -> dict[str, Any]:
    cmd = [
        str(vllm_python),
        str(ENGINE_RUN),
        *("--dir", str(directory), "--pp", str(PP), "--no-generate"),
        *("--target", daemon.target, "--model", model, "--out", str(out)),
    ]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per stage worker
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"engine_run failed ({proc.returncode}):\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_each_stage_loads_its_layers_bit_identical_to_the_default_loader(
    vllm_python: Path,
    checkpoints: dict[str, Path],
    daemon: RunningDaemon,
    tmp_path: Path,
    model: str,
) -> None:
    result = _run(vllm_python, checkpoints[model], daemon, model, tmp_path / "result.json")
    ours, theirs = result["weightd"], result["auto"]
    assert len(ours["digests"]) == PP
    for stage, (a, b) in enumerate(zip(ours["digests"], theirs["digests"], strict=True)):
        assert a == b, f"stage {stage}: {sorted(k for k in a if a[k] != b.get(k))}"
    assert theirs["reports"] == [None] * PP

    every = _checkpoint_names(checkpoints[model])
    received: list[set[str]] = []
    for stage, report in enumerate(ours["reports"]):
        assert report["pp"] == [PP, stage, [1, 1]]  # vLLM's split of 2 layers
        assert report["layout"] == [1, 0]
        assert report["transport"] == "shm"
        names = set(report["shapes"])
        layers = {int(m.group(1)) for n in names if (m := re.search(r"\.layers\.(\d+)\.", n))}
        assert layers == {stage}, f"stage {stage} received layers {sorted(layers)}"
        received.append(names)
    first, last = received
    assert "model.embed_tokens.weight" in first
    assert "model.norm.weight" in last and "model.norm.weight" not in first
    if "lm_head.weight" in every:  # llama: the untied head lives on the last stage only
        assert "lm_head.weight" in last and "lm_head.weight" not in first
    else:  # qwen2: tied, so the last stage's head is the embedding's bytes
        assert "model.embed_tokens.weight" in last
    # Together the stages received every tensor, and no stage received all of them.
    assert first | last == every
    assert every not in (first, last)
