"""A Llama-style checkpoint of some tens of MB, generated deterministically (no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def write_big_model(directory: Path) -> Path:
    from weightd.server.cli.demo import write_llama_checkpoint

    write_llama_checkpoint(str(directory), BIG_CONFIG, shards=2, seed=7)
    return directory
