"""Fake checkpoints for the planner's tests: llama-style configs and tensors, in memory.

Checkpoints are built in memory (``Checkpoint``/``TensorInfo`` with made-up offsets)
over a fake byte buffer per shard, so a plan's run pattern can be gathered from the
buffer and compared with the slice numpy cuts from the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightd.common.dtypes import DTYPE_BITS
from weightd.server.checkpoint.description import Checkpoint, TensorInfo
from weightd.server.store.runs import RunPattern

DATA_START = 200  # a made-up header size: tensors start at absolute offsets >= this
NUMPY_FOR = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

Spec = tuple[str, tuple[int, ...]]


@dataclass
class Fake:
    ckpt: Checkpoint
    buffers: dict[str, bytes]

    def array(self, name: str) -> np.ndarray:
        t = self.ckpt.tensors[name]
        count = math.prod(t.shape)
        dt = NUMPY_FOR[DTYPE_BITS[t.dtype] // 8]
        return np.frombuffer(self.buffers[t.shard], dt, count, t.offset).reshape(t.shape)

    def gather(self, shard: str, pattern: RunPattern) -> bytes:
        buf = self.buffers[shard]
        return b"".join(buf[o : o + n] for o, n in pattern.ranges())


def fake_checkpoint(
    config: Mapping[str, Any], specs: Mapping[str, Spec], *, shards: int = 1, seed: int = 0
) -> Fake:
    """Tensors laid out back to back (8-byte aligned) after DATA_START, round-robin in shards."""
    rng = np.random.default_rng(seed)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    cursor = dict.fromkeys(names, DATA_START)
    infos: list[TensorInfo] = []
    for i, (name, (dtype, shape)) in enumerate(specs.items()):
        shard = names[i % shards]
        nbytes = math.prod(shape) * DTYPE_BITS[dtype] // 8
        offset = cursor[shard]
        infos.append(TensorInfo(name, dtype, tuple(shape), shard, offset, nbytes))
        cursor[shard] = offset + nbytes + (-nbytes % 8)
    buffers = {s: rng.bytes(cursor[s] + 64) for s in names}
    infos.sort(key=lambda t: (names.index(t.shard), t.offset))
    ckpt = Checkpoint(
        name="tiny",
        root="/nonexistent/tiny",
        config=dict(config),
        config_json="{}",
        tensors={t.name: t for t in infos},
        shards=tuple(names),
    )
    return Fake(ckpt, buffers)


def llama_config(
    arch: str = "LlamaForCausalLM",
    *,
    heads: int = 8,
    kv: int = 2,
    head_dim: int | None = 16,
    hidden: int = 64,
    inter: int = 128,
    vocab: int = 256,
    layers: int = 2,
) -> dict[str, Any]:
    c: dict[str, Any] = {
        "architectures": [arch],
        "model_type": arch.removesuffix("ForCausalLM").lower(),
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "num_hidden_layers": layers,
    }
    if head_dim is not None:
        c["head_dim"] = head_dim
    return c


def llama_specs(
    c: Mapping[str, Any],
    *,
    dtype: str = "BF16",
    qkv_bias: bool = False,
    qk_norm: bool = False,
    out_bias: bool = False,
    mlp_bias: bool = False,
    inv_freq: bool = False,
    tied: bool = False,
) -> dict[str, Spec]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    inter, vocab = c["intermediate_size"], c["vocab_size"]
    s: dict[str, Spec] = {"model.embed_tokens.weight": (dtype, (vocab, h))}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (dtype, (h,))
        s[p + "self_attn.q_proj.weight"] = (dtype, (heads * hd, h))
        s[p + "self_attn.k_proj.weight"] = (dtype, (kv * hd, h))
        s[p + "self_attn.v_proj.weight"] = (dtype, (kv * hd, h))
        if qkv_bias:
            s[p + "self_attn.q_proj.bias"] = (dtype, (heads * hd,))
            s[p + "self_attn.k_proj.bias"] = (dtype, (kv * hd,))
            s[p + "self_attn.v_proj.bias"] = (dtype, (kv * hd,))
        if qk_norm:
            s[p + "self_attn.q_norm.weight"] = (dtype, (hd,))
            s[p + "self_attn.k_norm.weight"] = (dtype, (hd,))
        s[p + "self_attn.o_proj.weight"] = (dtype, (h, heads * hd))
        if out_bias:
            s[p + "self_attn.o_proj.bias"] = (dtype, (h,))
        if inv_freq:
            s[p + "self_attn.rotary_emb.inv_freq"] = ("F32", (hd // 2,))
        s[p + "post_attention_layernorm.weight"] = (dtype, (h,))
        s[p + "mlp.gate_proj.weight"] = (dtype, (inter, h))
        s[p + "mlp.up_proj.weight"] = (dtype, (inter, h))
        s[p + "mlp.down_proj.weight"] = (dtype, (h, inter))
        if mlp_bias:
            s[p + "mlp.gate_proj.bias"] = (dtype, (inter,))
            s[p + "mlp.up_proj.bias"] = (dtype, (inter,))
            s[p + "mlp.down_proj.bias"] = (dtype, (h,))
    s["model.norm.weight"] = (dtype, (h,))
    if not tied:
        s["lm_head.weight"] = (dtype, (vocab, h))
    return s
