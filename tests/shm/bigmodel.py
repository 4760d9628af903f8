"""A Llama-style checkpoint of some tens of MB, generated deterministically (no download)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: 2 layers, hidden 1024, intermediate 2816, vocab 4096, GQA 16/4 heads: ~62 MB of BF16,
#: big enough that page sharing (or its absence) is obvious in smaps_rollup.
BIG_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def big_tensors(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": w(v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": w(h),
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "post_attention_layernorm.weight": w(h),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        }
    out |= {"model.norm.weight": w(h), "lm_head.weight": w(v, h)}
    return out


def write_big_model(directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(BIG_CONFIG))
    tensors = big_tensors(BIG_CONFIG)
    names = list(tensors)
    half = len(names) // 2
    weight_map: dict[str, str] = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / shard))
        weight_map |= dict.fromkeys(part, shard)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory
