"""A TP=2 Llama forward over torch.distributed (gloo), from slices fetched from weightd.

Used once (the PeftModel acceptance) or on every adapter event (the hot-swap test).

Each rank fetches its base slices and its LoRA slices from the daemon and runs
Megatron-style tensor parallelism by hand: vocab-parallel embedding and head,
column-parallel q/k/v/gate/up (with lora_B cut the same way), row-parallel o/down
(with lora_A cut the same way) followed by an all-reduce.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

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
    events: int = 0,
) -> None:
    """One forward with the adapter, its logits to ``out``; with ``events``, follow that
    many adapter events instead (:func:`follow`), writing into the folder ``out``."""
    import transformers
    from safetensors.torch import save_file

    from weightd.client import WeightClient

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ws)
    config = transformers.LlamaConfig.from_pretrained(base_dir)
    with WeightClient(target, timeout=120) as client:
        if events:
            follow(client, config, rank, ws, adapter, ids, Path(out), events)
        else:
            w = client.fetch(rank, ws, transport="grpc")
            lora = client.fetch_adapter(adapter, rank, ws, transport="grpc")
            logits = forward(w, lora.tensors, lora.scaling, config, ids, rank, ws)
            if rank == 0:
                save_file({"logits": logits.contiguous()}, out)
    # No rank leaves while the other may still be in gloo: a peer's socket closing
    # under a pending operation can abort the process (the likely cause of a SIGABRT
    # seen once under load; not reproduced in 12 reruns).
    dist.barrier()
    dist.destroy_process_group()


def follow(
    client: Any,
    config: Any,
    rank: int,
    ws: int,
    adapter: str,
    ids: list[int],
    folder: Path,
    events: int,
) -> None:
    """Watch adapters; on each of ``events`` events about ``adapter``, run the whole model.

    The base comes once from a shared-memory pack; on a load or replace the rank fetches
    its slice of the adapter's current version (shared memory again), on an unload it
    runs the base alone. Each forward's logits go to ``<folder>/<n>-r<rank>.safetensors``
    with the event and the version actually fetched as metadata, written atomically so
    the test never reads half a file.
    """
    from safetensors.torch import save_file

    w = client.fetch(rank, ws)
    watch = client.watch_adapters()
    (folder / f"watching-{rank}").touch()
    seen = 0
    for e in watch:
        if e.name != adapter:
            continue
        meta = {"kind": e.kind, "event_version": str(e.version)}
        if e.kind == "unload":
            logits = forward(w, {}, {}, config, ids, rank, ws)
            meta.update(fetched_version="", transport="")
        else:
            got = client.fetch_adapter(adapter, rank, ws)
            logits = forward(w, got.tensors, got.scaling, config, ids, rank, ws)
            meta.update(fetched_version=str(got.version), transport=got.transport)
            del got  # ends this version's lease: the worker has applied it
        path = folder / f"{seen}-r{rank}.safetensors"
        save_file({"logits": logits.contiguous()}, f"{path}.tmp", metadata=meta)
        os.replace(f"{path}.tmp", path)
        seen += 1
        if seen == events:
            break
    watch.close()


def forward(
    w: dict[str, torch.Tensor],
    lora: dict[str, torch.Tensor],
    scaling: dict[str, float],
    config: Any,
    ids: list[int],
    rank: int,
    ws: int,
) -> torch.Tensor:
    """The whole model's logits (on every rank) from this rank's base and LoRA slices.

    ``scaling`` names the modules the adapter modifies (empty: the base model alone).
    """
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    def lin(x: torch.Tensor, module: str) -> torch.Tensor:
        y = x @ w[f"{module}.weight"].T
        if module in scaling:
            a = lora[f"{module}.lora_A.weight"]
            b = lora[f"{module}.lora_B.weight"]
            y = y + scaling[module] * ((x @ a.T) @ b.T)
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
    return torch.cat(parts, dim=-1)
