"""The built-in demo checkpoint: a small Llama-style model, sharded with an index.

Created deterministically (fixed seed, fixed layout) on first use in a cache
directory, so ``weightd serve`` with no ``--model`` works on a fresh machine without
downloading anything. It is a real ``LlamaForCausalLM`` checkpoint: ``transformers``
loads it, and it has GQA (4 kv heads for 8 query heads) so TP up to 8 exercises the
kv-head rules.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any, Final

DEMO_NAME: Final = "llama-demo"
DEMO_VERSION: Final = "v1"
DEMO_CONFIG: Final[dict[str, Any]] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_SHARDS: Final = 3


def llama_tensors(config: dict[str, Any], seed: int = 20261202) -> dict[str, Any]:
    """Deterministic random weights of a Llama-style model (norms are ones)."""
    import torch

    c = config
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        out[p + "self_attn.q_proj.weight"] = rand(q, h)
        out[p + "self_attn.k_proj.weight"] = rand(kv, h)
        out[p + "self_attn.v_proj.weight"] = rand(kv, h)
        out[p + "self_attn.o_proj.weight"] = rand(h, q)
        out[p + "mlp.gate_proj.weight"] = rand(inter, h)
        out[p + "mlp.up_proj.weight"] = rand(inter, h)
        out[p + "mlp.down_proj.weight"] = rand(h, inter)
    out["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out["lm_head.weight"] = rand(v, h)
    return out


def write_llama_checkpoint(
    directory: str, config: dict[str, Any], shards: int = _SHARDS, seed: int = 20261202
) -> None:
    """Write a sharded Llama-style checkpoint with an index (``directory`` must not exist).

    Also used by tests and benchmarks that need bigger checkpoints than the demo's.
    """
    from safetensors.torch import save_file

    tensors = llama_tensors(config, seed)
    names = list(tensors)
    per = -(-len(names) // shards)
    os.makedirs(directory)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
        save_file(part, os.path.join(directory, file), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_demo_checkpoint(directory: str) -> None:
    """Write the demo checkpoint into ``directory`` (which must not exist yet)."""
    write_llama_checkpoint(directory, DEMO_CONFIG)


def demo_checkpoint_path(cache_dir: str) -> str:
    """Where the demo checkpoint lives under ``cache_dir`` (nothing is created).

    The directory is named ``DEMO_NAME`` (the version is its parent), because a model's
    default name is its directory's name: ``serve`` with no ``--model`` and ``serve
    --model`` on this path must serve the same name.
    """
    return os.path.join(cache_dir, "demo", DEMO_VERSION, DEMO_NAME)


def ensure_demo_checkpoint(cache_dir: str) -> str:
    """The demo checkpoint's directory under ``cache_dir``, created atomically if missing."""
    target = demo_checkpoint_path(cache_dir)
    if os.path.isdir(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".demo-", dir=os.path.dirname(target))
    try:
        write_demo_checkpoint(os.path.join(staging, DEMO_NAME))
        try:
            os.rename(os.path.join(staging, DEMO_NAME), target)
        except OSError:
            if not os.path.isdir(target):  # lost a race with another creator: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
