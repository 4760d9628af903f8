"""A rules file as a user writes one (docs/guides/layouts.md shows the same table)."""

from __future__ import annotations

from typing import Any

MY_LLAMA_RULES: dict[str, Any] = {
    "family": "my-llama",
    "architectures": ["MyLlamaForCausalLM"],
    "attention": {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"},
    "layers": {"count": "num_hidden_layers", "pattern": r"\.layers\.(?P<layer>\d+)\."},
    "rules": [
        {"match": r"\.q_proj\.weight$", "split": "q_heads"},
        {"match": r"\.(k_proj|v_proj)\.weight$", "split": "kv_heads"},
        {"match": r"\.o_proj\.weight$", "split": "o_heads"},
        {"match": r"\.(gate_proj|up_proj)\.weight$", "split": "column"},
        {"match": r"\.down_proj\.weight$", "split": "row"},
        {"match": r"^model\.embed_tokens\.weight$", "split": "vocab", "stage": "embedding"},
        {"match": r"^lm_head\.weight$", "split": "vocab", "stage": "head"},
        {"match": r"^model\.norm\.weight$", "split": "replicated", "stage": "last"},
        {"match": r"layernorm\.weight$", "split": "replicated"},
    ],
}
