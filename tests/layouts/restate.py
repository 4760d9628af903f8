"""The layout rules of issue 4, restated with plain torch indexing.

Deliberately independent of weightd's rule tables and planner: it decides from the
tensor *name* (and config) which worker holds a tensor and which slice, so tests
compare the daemon against the rules' prose rather than against itself. Dense
tensors only; quantized modules are checked by dequantizing (``quantfmt``).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class L:
    """A layout, as the tests spell it."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0


def every(tp: int = 1, pp: int = 1, ep: int = 1) -> list[L]:
    return [L(tp, t, pp, p, ep, e) for p in range(pp) for e in range(ep) for t in range(tp)]


def vllm_stages(num_layers: int, pp: int) -> list[range]:
    """vLLM's get_pp_indices: equal blocks, remainder to the stages before the last."""
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def num_experts(config: Mapping[str, Any]) -> int | None:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return int(config[key])
    return None


def holds(name: str, config: Mapping[str, Any], lay: L, names: Collection[str]) -> bool:
    """Whether the worker at ``lay`` receives tensor ``name``."""
    if lay.pp > 1:
        stages = vllm_stages(int(config["num_hidden_layers"]), lay.pp)
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        last = lay.pp - 1
        if m:
            if int(m.group(1)) not in stages[lay.pp_rank]:
                return False
        elif name.endswith("embed_tokens.weight"):
            tied = "lm_head.weight" not in names
            if lay.pp_rank != 0 and not (tied and lay.pp_rank == last):
                return False
        elif name in ("lm_head.weight", "model.norm.weight"):
            if lay.pp_rank != last:
                return False
        elif not name.endswith("rotary_emb.inv_freq"):
            raise AssertionError(f"no stage restated for {name}")
    m = re.search(r"\.experts\.(\d+)\.", name)
    if m and lay.ep > 1:
        per = num_experts(config) // lay.ep  # type: ignore[operator]
        return int(m.group(1)) // per == lay.ep_rank
    return True


def _kv(t: torch.Tensor, config: Mapping[str, Any], tp: int, r: int, dim: int = 0) -> torch.Tensor:
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or config["hidden_size"] // heads)
    if tp <= kv:
        return t.chunk(tp, dim)[r]
    head = r // (tp // kv)
    return t.narrow(dim, head * hd, hd)


def expected(name: str, t: torch.Tensor, config: Mapping[str, Any], lay: L) -> torch.Tensor:
    """The slice of ``t`` the worker at ``lay`` receives (when it holds it)."""
    tp, r = lay.tp, lay.tp_rank
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        if lay.ep > 1:
            t = t.chunk(lay.ep, 0)[lay.ep_rank]
        if tp == 1:
            return t
        if name.endswith("gate_up_proj"):
            gate, up = t.chunk(2, 1)
            return torch.cat([gate.chunk(tp, 1)[r], up.chunk(tp, 1)[r]], 1)
        return t.chunk(tp, 2)[r]
    if tp == 1:
        return t
    if re.search(r"\.self_attn\.(k_proj|v_proj)\.(weight|bias)$", name):
        return _kv(t, config, tp, r)
    if re.search(r"\.self_attn\.qkv_proj\.weight$", name):
        heads = int(config["num_attention_heads"])
        hd = int(config.get("head_dim") or config["hidden_size"] // heads)
        kv = int(config.get("num_key_value_heads") or heads)
        q, k, v = t.split([heads * hd, kv * hd, kv * hd], 0)
        return torch.cat([q.chunk(tp, 0)[r], _kv(k, config, tp, r), _kv(v, config, tp, r)], 0)
    if re.search(r"\.mlp\.gate_up_proj\.weight$", name):
        gate, up = t.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]], 0)
    if re.search(r"\.(q_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)$", name):
        return t.chunk(tp, 0)[r]
    if re.search(r"\.(o_proj|down_proj|w2)\.weight$", name):
        return t.chunk(tp, 1)[r]
    if re.search(r"(embed_tokens|lm_head)\.weight$", name):
        return t.chunk(tp, 0)[r]
    # norms, q_norm/k_norm, o/down biases, routers, shared-expert gates, rotary buffers
    return t
