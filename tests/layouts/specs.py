"""Tensor names and shapes of each built-in architecture, as its checkpoints spell them.

Written from the architectures' own checkpoints (transformers ``save_pretrained``
output), not from weightd's tables. Sizes divide by tp 1, 2, 4 and 8 where the
rules need it; layer and expert counts are small but uneven enough to matter.
"""

from __future__ import annotations

from typing import Any

from tests.layouts.fakes import Spec

BASE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_hidden_layers": 3,
}


def config(arch: str, model_type: str, **over: Any) -> dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type, **BASE, **over}


def _attention(c: dict[str, Any], p: str, dtype: str, bias: bool, qk_norm: bool) -> dict[str, Spec]:
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    s: dict[str, Spec] = {
        p + "self_attn.q_proj.weight": (dtype, (q, h)),
        p + "self_attn.k_proj.weight": (dtype, (kv, h)),
        p + "self_attn.v_proj.weight": (dtype, (kv, h)),
        p + "self_attn.o_proj.weight": (dtype, (h, q)),
    }
    if bias:
        s[p + "self_attn.q_proj.bias"] = (dtype, (q,))
        s[p + "self_attn.k_proj.bias"] = (dtype, (kv,))
        s[p + "self_attn.v_proj.bias"] = (dtype, (kv,))
        s[p + "self_attn.o_proj.bias"] = (dtype, (h,))
    if qk_norm:
        s[p + "self_attn.q_norm.weight"] = (dtype, (hd,))
        s[p + "self_attn.k_norm.weight"] = (dtype, (hd,))
    return s


def _mlp(p: str, h: int, inter: int, dtype: str, bias: bool = False) -> dict[str, Spec]:
    s: dict[str, Spec] = {
        p + "gate_proj.weight": (dtype, (inter, h)),
        p + "up_proj.weight": (dtype, (inter, h)),
        p + "down_proj.weight": (dtype, (h, inter)),
    }
    if bias:
        s[p + "gate_proj.bias"] = (dtype, (inter,))
        s[p + "up_proj.bias"] = (dtype, (inter,))
        s[p + "down_proj.bias"] = (dtype, (h,))
    return s


def _model(
    c: dict[str, Any], layers: dict[str, Spec], dtype: str, tied: bool, inv_freq: bool
) -> dict[str, Spec]:
    h, v = c["hidden_size"], c["vocab_size"]
    s: dict[str, Spec] = {"model.embed_tokens.weight": (dtype, (v, h)), **layers}
    s["model.norm.weight"] = (dtype, (h,))
    if inv_freq:
        s["model.rotary_emb.inv_freq"] = ("F32", (c["head_dim"] // 2,))
    if not tied:
        s["lm_head.weight"] = (dtype, (v, h))
    return s


def llama(
    c: dict[str, Any],
    *,
    dtype: str = "BF16",
    bias: bool = False,
    mlp_bias: bool = False,
    qk_norm: bool = False,
    tied: bool = False,
    inv_freq: bool = False,
) -> dict[str, Spec]:
    h, inter = c["hidden_size"], c["intermediate_size"]
    layers: dict[str, Spec] = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layers[p + "input_layernorm.weight"] = (dtype, (h,))
        layers.update(_attention(c, p, dtype, bias, qk_norm))
        layers[p + "post_attention_layernorm.weight"] = (dtype, (h,))
        layers.update(_mlp(p + "mlp.", h, inter, dtype, mlp_bias))
    return _model(c, layers, dtype, tied, inv_freq)


def phi3(c: dict[str, Any], dtype: str = "BF16") -> dict[str, Spec]:
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    op = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    layers: dict[str, Spec] = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layers[p + "input_layernorm.weight"] = (dtype, (h,))
        layers[p + "self_attn.qkv_proj.weight"] = (dtype, (op, h))
        layers[p + "self_attn.o_proj.weight"] = (dtype, (h, c["num_attention_heads"] * hd))
        layers[p + "post_attention_layernorm.weight"] = (dtype, (h,))
        layers[p + "mlp.gate_up_proj.weight"] = (dtype, (2 * inter, h))
        layers[p + "mlp.down_proj.weight"] = (dtype, (h, inter))
    return _model(c, layers, dtype, False, False)


def mixtral(c: dict[str, Any], dtype: str = "BF16") -> dict[str, Spec]:
    h, inter, e = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    layers: dict[str, Spec] = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layers[p + "input_layernorm.weight"] = (dtype, (h,))
        layers.update(_attention(c, p, dtype, False, False))
        layers[p + "post_attention_layernorm.weight"] = (dtype, (h,))
        layers[p + "block_sparse_moe.gate.weight"] = (dtype, (e, h))
        for x in range(e):
            q = f"{p}block_sparse_moe.experts.{x}."
            layers[q + "w1.weight"] = (dtype, (inter, h))
            layers[q + "w2.weight"] = (dtype, (h, inter))
            layers[q + "w3.weight"] = (dtype, (inter, h))
    return _model(c, layers, dtype, False, False)


def qwen_moe(
    c: dict[str, Any],
    dtype: str = "BF16",
    *,
    shared: str | None = "shared_expert",
    shared_gate: bool = True,
    dense_layers: tuple[int, ...] = (),
    bias: bool = True,
    qk_norm: bool = False,
    router_bias: bool = False,
    expert_bias: bool = False,
) -> dict[str, Spec]:
    """Qwen2-MoE (``shared_expert`` + gate), Qwen3-MoE (none), DeepSeek (``shared_experts``)."""
    h, e = c["hidden_size"], c["num_experts"]
    inter = c["moe_intermediate_size"]
    layers: dict[str, Spec] = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layers[p + "input_layernorm.weight"] = (dtype, (h,))
        layers.update(_attention(c, p, dtype, bias, qk_norm))
        layers[p + "post_attention_layernorm.weight"] = (dtype, (h,))
        if i in dense_layers:
            layers.update(_mlp(p + "mlp.", h, c["intermediate_size"], dtype))
            continue
        layers[p + "mlp.gate.weight"] = (dtype, (e, h))
        if router_bias:
            layers[p + "mlp.gate.e_score_correction_bias"] = ("F32", (e,))
        for x in range(e):
            layers.update(_mlp(f"{p}mlp.experts.{x}.", h, inter, dtype, expert_bias))
        if shared:
            layers.update(_mlp(f"{p}mlp.{shared}.", h, c["shared_expert_intermediate_size"], dtype))
        if shared_gate:
            layers[p + "mlp.shared_expert_gate.weight"] = (dtype, (1, h))
    return _model(c, layers, dtype, False, False)


def stacked_moe(c: dict[str, Any], dtype: str = "BF16") -> dict[str, Spec]:
    """transformers v5's in-memory MoE layout, as a checkpoint: experts stacked on dim 0."""
    h, inter, e = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    layers: dict[str, Spec] = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layers[p + "input_layernorm.weight"] = (dtype, (h,))
        layers.update(_attention(c, p, dtype, False, False))
        layers[p + "post_attention_layernorm.weight"] = (dtype, (h,))
        layers[p + "mlp.gate.weight"] = (dtype, (e, h))
        layers[p + "mlp.experts.gate_up_proj"] = (dtype, (e, 2 * inter, h))
        layers[p + "mlp.experts.down_proj"] = (dtype, (e, h, inter))
    return _model(c, layers, dtype, False, False)


MOE_BASE = {
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}

#: (config, specs) of every built-in architecture family variant the planner tests use.
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Spec]]] = {}


def _add(name: str, c: dict[str, Any], s: dict[str, Spec]) -> None:
    VARIANTS[name] = (c, s)


_c = config("LlamaForCausalLM", "llama")
_add("llama", _c, llama(_c, inv_freq=True, bias=True, mlp_bias=True))
_c = config("LlamaForCausalLM", "llama", tie_word_embeddings=True)
_add("llama-tied", _c, llama(_c, tied=True))
_c = config("MistralForCausalLM", "mistral")
_add("mistral", _c, llama(_c, dtype="F32"))
_c = config("Qwen2ForCausalLM", "qwen2")
_add("qwen2", _c, llama(_c, bias=True))
_c = config("Qwen3ForCausalLM", "qwen3")
_add("qwen3", _c, llama(_c, qk_norm=True))
_c = config("GemmaForCausalLM", "gemma", num_key_value_heads=1, tie_word_embeddings=True)
_add("gemma", _c, llama(_c, tied=True))
_c = config("Gemma2ForCausalLM", "gemma2", num_key_value_heads=4, tie_word_embeddings=True)
_add("gemma2", _c, llama(_c, tied=True))
_c = config("Phi3ForCausalLM", "phi3")
_add("phi3", _c, phi3(_c))
_c = config("MixtralForCausalLM", "mixtral", num_local_experts=4, **MOE_BASE)
_add("mixtral", _c, mixtral(_c))
_c = config("Qwen2MoeForCausalLM", "qwen2_moe", num_experts=8, **MOE_BASE)
_add("qwen2-moe", _c, qwen_moe(_c, dense_layers=(0,)))
_c = config("Qwen3MoeForCausalLM", "qwen3_moe", num_experts=4, **MOE_BASE)
_add("qwen3-moe", _c, qwen_moe(_c, shared=None, shared_gate=False, bias=False, qk_norm=True))
_c = config("Qwen2MoeForCausalLM", "qwen2_moe", num_experts=4, **MOE_BASE)
_add(
    "deepseek-names",
    _c,
    qwen_moe(
        _c,
        shared="shared_experts",
        shared_gate=False,
        bias=False,
        router_bias=True,
        expert_bias=True,
    ),
)
_c = config("MixtralForCausalLM", "mixtral", num_local_experts=4, **MOE_BASE)
_add("stacked-experts", _c, stacked_moe(_c))
