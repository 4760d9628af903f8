"""Benchmark checkpoints (generated, never downloaded) and the peer loader's TP slicing."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

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


def write_checkpoint(directory: Path, config: dict[str, Any] = BENCH_CONFIG) -> Path:
    """Write (once) a deterministic random checkpoint with an index; returns ``directory``."""
    from weightd.server.cli.demo import write_llama_checkpoint

    if not (directory / "model.safetensors.index.json").exists():
        staging = directory.with_name(f".{directory.name}.{os.getpid()}")
        write_llama_checkpoint(str(staging), config, shards=3, seed=0)
        staging.rename(directory)
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
