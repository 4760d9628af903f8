"""The Llama-family TP rules as the peers apply them (what a loader does by hand)."""

from __future__ import annotations

import re
from typing import Any


def split_of(name: str, config: dict[str, Any], ws: int, rank: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of rank's part, or None when the tensor is replicated."""
    if ws == 1:
        return None
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if re.search(r"\.(k_proj|v_proj)\.(weight|bias)$", name):
        if ws <= kv:
            per = kv * head_dim // ws
            return 0, rank * per, (rank + 1) * per
        head = rank // (ws // kv)
        return 0, head * head_dim, (head + 1) * head_dim
    size_of = {
        "q_proj": heads * head_dim,
        "gate_proj": config["intermediate_size"],
        "up_proj": config["intermediate_size"],
        "o_proj": heads * head_dim,
        "down_proj": config["intermediate_size"],
        "embed_tokens": config["vocab_size"],
        "lm_head": config["vocab_size"],
    }
    m = re.search(r"(q_proj|gate_proj|up_proj|embed_tokens|lm_head)\.weight$", name)
    if m or re.search(r"\.(q_proj|gate_proj|up_proj)\.bias$", name):
        key = m.group(1) if m else name.split(".")[-2]
        per = size_of[key] // ws
        return 0, rank * per, (rank + 1) * per
    m = re.search(r"\.(o_proj|down_proj)\.weight$", name)
    if m:
        per = size_of[m.group(1)] // ws
        return 1, rank * per, (rank + 1) * per
    return None
