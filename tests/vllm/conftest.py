"""tests/vllm: the real vLLM engine loading from a real daemon, both out of process.

vLLM pins its own torch and transformers, so it lives in ``.venv-vllm`` (built by
``.ci/setup.sh``); these tests run in the project's venv, start ``weightd serve`` and
``engine_run.py`` under ``.venv-vllm/bin/python``. Engine start-up costs ~40 s on
a quiet machine here, so each (model, TP size) gets one process running both loaders,
shared by every assertion (module-scoped fixtures). ``WEIGHTD_VLLM=0`` skips them
(the set-up then builds no ``.venv-vllm``); otherwise a missing venv is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningDaemon, run_daemon
from tests.models import build_model
from tests.old_daemon import FieldForgettingProxy, without_vocab_pad

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("WEIGHTD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

#: Llama with GQA (8 query / 2 kv heads), a vocabulary that is not a multiple of vLLM's
#: padding (64), untied head. Qwen2: q/k/v biases, tied embeddings, one kv head, so
#: TP=2 replicates it.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "llama",
        dict(
            vocab_size=1000,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": (
        "qwen2",
        dict(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        ),
    ),
}


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    if os.environ.get("WEIGHTD_VLLM") == "0":
        pytest.skip("WEIGHTD_VLLM=0: the vLLM venv is not set up, vLLM tests skipped")
    assert VLLM_PYTHON.exists(), (
        f"{VLLM_PYTHON} is missing: run .ci/setup.sh (or set WEIGHTD_VLLM=0 to skip)"
    )
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, vllm_python: Path) -> dict[str, Path]:
    import torch

    root = tmp_path_factory.mktemp("vllm-models")
    out = {}
    for name, (kind, overrides) in MODELS.items():
        model = build_model(kind, overrides).to(torch.bfloat16)
        model.save_pretrained(root / name, max_shard_size="400KB")
        out[name] = root / name
    # A fine-tune of the llama: the same config, index and shard sizes, other weights.
    kind, overrides = MODELS["llama"]
    build_model(kind, overrides, seed=1).to(torch.bfloat16).save_pretrained(
        root / FINETUNE, max_shard_size="400KB"
    )
    out[FINETUNE] = root / FINETUNE
    return out


@pytest.fixture(scope="session")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]
) -> Iterator[RunningDaemon]:
    with run_daemon(
        tmp_path_factory.mktemp("vllm-daemon"), sorted(checkpoints.items()), DECLARED
    ) as d:
        yield d


@pytest.fixture(scope="session")
def old_daemon(
    daemon: RunningDaemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FieldForgettingProxy]:
    old = without_vocab_pad(daemon.target, tmp_path_factory.mktemp("old-daemon") / "old.sock")
    try:
        yield old
    finally:
        old.close()


EngineResult = dict[str, Any]

#: The session daemon's checkpoint with the llama's shapes and other weights.
FINETUNE = "llama_ft"
#: Every layout these engines ask for, declared: their packs are built before the
#: daemon reports SERVING, so each engine's first load maps a prebuilt pack (vLLM asks
#: for vocab_pad 64 above TP=1; the pipeline test splits 2 layers 1+1).
DECLARED = [
    *("--layout", "tp=1"),
    *("--layout", "tp=2,vocab_pad=64"),
    *("--layout", "tp=1,pp=2,pp_layers=1+1"),
]


@pytest.fixture(scope="session")
def engine(
    vllm_python: Path,
    checkpoints: dict[str, Path],
    daemon: RunningDaemon,
    old_daemon: FieldForgettingProxy,
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, int], EngineResult]:
    """``engine(model, tp)``: both loaders' results for that engine, run once and cached."""
    cache: dict[tuple[str, int], EngineResult] = {}

    def run(name: str, tp: int) -> EngineResult:
        if (name, tp) in cache:
            return cache[(name, tp)]
        out = tmp_path_factory.mktemp(f"engine-{name}-tp{tp}") / "result.json"
        env = dict(os.environ)
        if tp == 2:  # one core per worker (vLLM's CPU workers bind threads per NUMA node)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        other = next(n for n in checkpoints if n not in (name, FINETUNE))
        cmd = [
            str(vllm_python),
            str(Path(__file__).with_name("engine_run.py")),
            *("--dir", str(checkpoints[name]), "--tp", str(tp), "--target", daemon.target),
            *("--model", name, "--other-model", other, "--out", str(out)),
            *(
                ["--checks", "--finetune-model", FINETUNE, "--loaders", "weightd,auto,fallback"]
                if (name, tp) == ("llama", 1)
                else []
            ),
            # Against a daemon that predates vocab_pad: equal blocks, re-cut by the loader.
            *(
                ["--old-target", old_daemon.target, "--loaders", "weightd,auto,weightd_old"]
                if (name, tp) == ("llama", 2)
                else []
            ),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (
            f"engine_run failed ({proc.returncode}):\n{proc.stderr[-8000:]}"
        )
        result: EngineResult = json.loads(out.read_text())
        result["log"] = proc.stdout + proc.stderr  # vLLM's workers log to stdout
        cache[(name, tp)] = result
        return result

    return run
