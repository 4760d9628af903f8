"""Benchmark checkpoints (generated, never downloaded) and the peer loader's TP slicing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

#: TinyLlama widths with 3 layers and a 32k vocabulary: ~526 MB of BF16 in 3 shards.
BENCH_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 3,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def _tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
    out |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return out


def write_checkpoint(
    directory: Path, config: dict[str, Any] = BENCH_CONFIG, shards: int = 3
) -> Path:
    """Write (once) a deterministic random checkpoint with an index; returns ``directory``."""
    from safetensors.torch import save_file

    if (directory / "model.safetensors.index.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    shapes = _tensors(config)
    names = list(shapes)
    g = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    per = -(-len(names) // shards)
    for i in range(shards):
        part = names[i * per : (i + 1) * per]
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=g).to(torch.bfloat16) for n in part}
        save_file(tensors, str(directory / f".{shard}.tmp"))
        (directory / f".{shard}.tmp").rename(directory / shard)
        weight_map |= dict.fromkeys(part, shard)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def split_of(name: str, config: dict[str, Any], ws: int, rank: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of rank's slice of ``name`` under weightd's Llama rules; None: whole."""
    heads = config["num_attention_heads"]
    kv = config["num_key_value_heads"]
    head_dim = config["head_dim"]
    if ws == 1:
        return None
    if re.search(r"\.(k_proj|v_proj)\.weight$", name):
        if ws <= kv:
            per = kv * head_dim // ws
            return 0, rank * per, (rank + 1) * per
        head = rank // (ws // kv)
        return 0, head * head_dim, (head + 1) * head_dim
    if re.search(r"\.(q_proj|gate_proj|up_proj)\.weight$", name):
        size = heads * head_dim if "q_proj" in name else config["intermediate_size"]
        return 0, rank * size // ws, (rank + 1) * size // ws
    if re.search(r"\.(o_proj|down_proj)\.weight$", name):
        size = heads * head_dim if "o_proj" in name else config["intermediate_size"]
        return 1, rank * size // ws, (rank + 1) * size // ws
    if re.search(r"(embed_tokens|lm_head)\.weight$", name):
        size = config["vocab_size"]
        return 0, rank * size // ws, (rank + 1) * size // ws
    return None
