"""A TP=2 Llama forward over torch.distributed (gloo), from slices fetched from weightd.

Each rank fetches its base slices and its LoRA slices from the daemon and runs
Megatron-style tensor parallelism by hand: vocab-parallel embedding and head,
column-parallel q/k/v/gate/up (with lora_B cut the same way), row-parallel o/down
(with lora_A cut the same way) followed by an all-reduce.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rank_main(
    rank: int,
    ws: int,
    target: str,
    base_dir: str,
    adapter: str,
    ids: list[int],
    init: str,
    out: str,
) -> None:
    import transformers
    from safetensors.torch import save_file
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from weightd.client import WeightClient

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ws)
    config = transformers.LlamaConfig.from_pretrained(base_dir)
    with WeightClient(target, timeout=120) as client:
        w = client.fetch(rank, ws, transport="grpc")
        lora = client.fetch_adapter(adapter, rank, ws)

    def lin(x: torch.Tensor, module: str) -> torch.Tensor:
        y = x @ w[f"{module}.weight"].T
        if module in lora.scaling:
            a = lora.tensors[f"{module}.lora_A.weight"]
            b = lora.tensors[f"{module}.lora_B.weight"]
            y = y + lora.scaling[module] * ((x @ a.T) @ b.T)
        return y

    tokens = torch.tensor([ids])
    seq = tokens.shape[1]
    emb = w["model.embed_tokens.weight"]
    per = emb.shape[0]
    local = tokens - rank * per
    mask = (local >= 0) & (local < per)
    x = emb[local.clamp(0, per - 1)] * mask[..., None]
    dist.all_reduce(x)
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    nh, nkv = heads // ws, max(1, kv // ws)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(seq)[None])
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    eps = config.rms_norm_eps
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        h = _rms(x, w[f"{p}.input_layernorm.weight"], eps)
        q = lin(h, f"{p}.self_attn.q_proj").view(1, seq, nh, hd).transpose(1, 2)
        k = lin(h, f"{p}.self_attn.k_proj").view(1, seq, nkv, hd).transpose(1, 2)
        v = lin(h, f"{p}.self_attn.v_proj").view(1, seq, nkv, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(nh // nkv, dim=1)
        v = v.repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + causal, dim=-1) @ v
        o = lin(att.transpose(1, 2).reshape(1, seq, nh * hd), f"{p}.self_attn.o_proj")
        dist.all_reduce(o)
        x = x + o
        h = _rms(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        m = lin(
            torch.nn.functional.silu(lin(h, f"{p}.mlp.gate_proj")) * lin(h, f"{p}.mlp.up_proj"),
            f"{p}.mlp.down_proj",
        )
        dist.all_reduce(m)
        x = x + m
    x = _rms(x, w["model.norm.weight"], eps)
    part = x @ w["lm_head.weight"].T
    parts = [torch.empty_like(part) for _ in range(ws)]
    dist.all_gather(parts, part)
    if rank == 0:
        save_file({"logits": torch.cat(parts, dim=-1).contiguous()}, out)
    dist.destroy_process_group()
