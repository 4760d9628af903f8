"""Forward equivalence: ranks that fetched their weights from the daemon compute what the
unsharded ``transformers`` module computes (fp32, max abs difference <= 1e-5).

One group of processes per world size (2 and 4) runs every scenario, with gloo; each
rank fetches its own slices over gRPC (``engine``). Scenarios:

* a Llama decoder layer (attention + MLP) at TP = world size: 8 query heads, 2 kv
  heads, so TP 4 is the ``world_size > num_key_value_heads`` case;
* a Phi-3 decoder layer with fused ``qkv_proj`` / ``gate_up_proj`` at TP 2 and 4;
* a Mixtral sparse-MoE block at EP 2 (and EP 2 x TP 2);
* a tied-embedding Llama in PP 2 stages (and PP 2 x TP 2): the last stage's logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import RunningDaemon

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-5


def _config(directory: Path) -> dict[str, Any]:
    c = json.loads((directory / "config.json").read_text())
    c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    if c.get("head_dim") is None:
        c["head_dim"] = c["hidden_size"] // c["num_attention_heads"]
    return c


def scenarios(world: int) -> list[dict[str, Any]]:
    half = world // 2
    return [
        {"name": "llama-layer", "kind": "layer", "model": "llama", "layer": 1, "tp": world},
        {"name": "phi3-layer", "kind": "layer", "model": "phi3", "layer": 0, "tp": world},
        {"name": "mixtral-moe", "kind": "moe", "model": "mixtral", "layer": 0, "ep": 2, "tp": half},
        {"name": "llama-pp", "kind": "pp", "model": "llama-tied", "pp": 2, "tp": half},
    ]


def references(
    models: dict[str, Path], specs: list[dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Inputs for the ranks and the unsharded transformers outputs."""
    import transformers

    gen = torch.Generator().manual_seed(7)
    inputs: dict[str, torch.Tensor] = {}
    want: dict[str, torch.Tensor] = {}
    for sc in specs:
        key, directory = sc["name"], models[sc["model"]]
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        model.eval()
        c = sc["config"] = _config(directory)
        pos = torch.arange(6).unsqueeze(0)
        h = torch.randn(2, 6, c["hidden_size"], generator=gen)
        with torch.no_grad():
            cos, sin = model.model.rotary_emb(h, pos)
            if sc["kind"] == "layer":
                layer = model.model.layers[sc["layer"]]
                out = layer(
                    h, attention_mask=None, position_embeddings=(cos, sin), position_ids=pos
                )
                want[key] = out[0] if isinstance(out, tuple) else out
                inputs.update({f"{key}.h": h, f"{key}.cos": cos, f"{key}.sin": sin})
            elif sc["kind"] == "moe":
                want[key] = model.model.layers[sc["layer"]].mlp(h)
                inputs[f"{key}.h"] = h
            else:
                ids = torch.randint(0, c["vocab_size"], (2, 6), generator=gen)
                want[key] = model(ids).logits
                inputs.update({f"{key}.ids": ids, f"{key}.cos": cos, f"{key}.sin": sin})
    return inputs, want


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_forward_matches_transformers(
    world: int, arch_models: dict[str, Path], layout_daemon: RunningDaemon, tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    specs = scenarios(world)
    inputs, want = references(arch_models, specs)
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(tmp_path / "inputs.safetensors"))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = []
    for rank in range(world):
        spec = {
            "world_size": world,
            "rank": rank,
            "init": f"file://{tmp_path}/rendezvous",
            "target": layout_daemon.target,
            "inputs": str(tmp_path / "inputs.safetensors"),
            "out": str(tmp_path / "out"),
            "scenarios": specs,
        }
        path = tmp_path / f"spec{rank}.json"
        path.write_text(json.dumps(spec))
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "tests.layouts.engine", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                ),
                log,
            )
        )
    try:
        for rank, (proc, log) in enumerate(procs):
            proc.wait(timeout=300)
            log.close()
            assert proc.returncode == 0, (tmp_path / f"rank{rank}.log").read_text()
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    got: dict[str, torch.Tensor] = {}
    for rank in range(world):
        got.update(load_file(str(tmp_path / f"out.rank{rank}.safetensors")))
    assert set(got) == set(want)
    for key in want:
        diff = (got[key] - want[key]).abs().max().item()
        print(f"{key} at world size {world}: max abs diff {diff:.3g}")  # shown with -s
        assert diff <= TOLERANCE, f"{key} at world size {world}: max abs diff {diff}"
    # Each stage held exactly its layers, the tied embedding also on the last stage.
    half = world // 2
    for rank in range(world):
        seen = json.loads((tmp_path / f"out.rank{rank}.json").read_text())["llama-pp"]["tensors"]
        layers = {n.split(".")[2] for n in seen if ".layers." in n}
        stage = rank // half
        assert layers == ({"0", "1"} if stage == 0 else {"2"}), (rank, layers)
        assert "model.embed_tokens.weight" in seen and "lm_head.weight" not in seen
        assert ("model.norm.weight" in seen) == (stage == 1)
        moe = json.loads((tmp_path / f"out.rank{rank}.json").read_text())["mixtral-moe"]["tensors"]
        experts = {n.split(".")[5] for n in moe if ".experts." in n}
        assert experts == ({"0", "1"} if (rank // half) % 2 == 0 else {"2", "3"}), (rank, experts)
