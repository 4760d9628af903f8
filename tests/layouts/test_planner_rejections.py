"""Every way a plan is refused, table-driven: error class and a detail naming the culprit."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from tests.layouts.fakes import Spec, fake_checkpoint
from tests.layouts.specs import VARIANTS, config, llama
from weightd.server.base.errors import (
    ConfigError,
    InvalidRequest,
    NoShardingRules,
    ShardingError,
    TensorNotFound,
    TensorNotInLayout,
    WeightdError,
)
from weightd.server.plan.builtin_rules import rules_for
from weightd.server.plan.layout import Layout
from weightd.server.plan.planner import plan


def variant(name: str) -> tuple[dict[str, Any], dict[str, Spec]]:
    c, s = VARIANTS[name]
    return copy.deepcopy(c), dict(s)


def change(
    name: str,
    config_over: dict[str, Any] | None = None,
    specs_over: dict[str, Spec | None] | None = None,
) -> Callable[[], tuple[dict[str, Any], dict[str, Spec]]]:
    def make() -> tuple[dict[str, Any], dict[str, Spec]]:
        c, s = variant(name)
        c.update(config_over or {})
        for k, v in (specs_over or {}).items():
            if v is None:
                s.pop(k)
            else:
                s[k] = v
        return c, s

    return make


L0 = "model.layers.0."
CASES = [
    # --- the layout itself
    ("llama", Layout(tp_size=0), (), InvalidRequest, ("world_size 0",)),
    ("llama", Layout(tp_size=2, tp_rank=2), (), InvalidRequest, ("rank 2", "world_size 2")),
    ("llama", Layout(pp_size=0), (), InvalidRequest, ("pp_size 0",)),
    ("llama", Layout(pp_size=2, pp_rank=2), (), InvalidRequest, ("pp_rank 2", "pp_size 2")),
    ("mixtral", Layout(ep_size=2, ep_rank=-1), (), InvalidRequest, ("ep_rank -1",)),
    ("llama", Layout(tp_size=2048), (), InvalidRequest, ("tp_size 2048", "1024")),
    ("llama", Layout(pp_size=2, pp_layers=(3,)), (), InvalidRequest, ("lists 1 stages",)),
    ("llama", Layout(pp_size=2, pp_layers=(4, -1)), (), InvalidRequest, ("negative",)),
    # --- names
    ("llama", Layout(2), ("model.nope",), TensorNotFound, ("'model.nope'", "'tiny'")),
    ("llama", Layout(2), ("model.norm.weight",) * 2, InvalidRequest, ("requested twice",)),
    (
        "llama",
        Layout(pp_size=3, pp_rank=0),
        ("model.norm.weight",),
        TensorNotInLayout,
        ("'model.norm.weight'", "pipeline stage 2", "a last tensor"),
    ),
    (
        "llama-tied",
        Layout(pp_size=3, pp_rank=1),
        ("model.embed_tokens.weight",),
        TensorNotInLayout,
        ("pipeline stage 0 and 2",),
    ),
    (
        "mixtral",
        Layout(ep_size=4, ep_rank=0),
        (L0 + "block_sparse_moe.experts.2.w1.weight",),
        TensorNotInLayout,
        ("expert 2 belongs to ep rank 2", "ep 0/4"),
    ),
    # --- rules
    (
        change("llama", {"architectures": ["FooForCausalLM"]}),
        Layout(2),
        (),
        NoShardingRules,
        ("'FooForCausalLM'", "asked for 2"),
    ),
    (
        change("llama", {"architectures": ["FooForCausalLM"]}),
        Layout(pp_size=2),
        (),
        NoShardingRules,
        ("pp 0/2",),
    ),
    (
        change("llama", specs_over={L0 + "mlp.router.weight": ("BF16", (4, 64))}),
        Layout(1, 0, 2),
        (),
        ShardingError,
        ("mlp.router.weight", "llama-family", "layout tp 0/1, pp 0/2"),
    ),
    (
        change("llama", specs_over={"model.extra.weight": ("BF16", (4,))}),
        Layout(2),
        (),
        ShardingError,
        ("model.extra.weight", "world_size 2"),
    ),
    (
        change("llama", specs_over={"model.rotary_emb.scale": ("F32", (4,))}),
        Layout(pp_size=2),
        (),
        ShardingError,
        ("rotary_emb.scale", "llama-family", "pp 0/2"),
    ),
    # --- tensor parallel sizes
    (
        "llama",
        Layout(3),
        (L0 + "self_attn.q_proj.weight",),
        ShardingError,
        ("q_proj.weight", "num_attention_heads=8", "world_size 3"),
    ),
    (
        "llama",
        Layout(16),
        (L0 + "self_attn.o_proj.weight",),
        ShardingError,
        ("o_proj.weight", "num_attention_heads=8", "world_size 16"),
    ),
    (
        change(
            "llama",
            {"num_attention_heads": 12, "num_key_value_heads": 6},
            {L0 + "self_attn.k_proj.weight": ("BF16", (48, 64))},
        ),
        Layout(5),
        (L0 + "self_attn.k_proj.weight",),
        ShardingError,
        ("k_proj.weight", "num_attention_heads=12", "world_size 5"),
    ),
    (
        change(
            "llama",
            {"num_attention_heads": 24, "num_key_value_heads": 6, "hidden_size": 64, "head_dim": 8},
            {L0 + "self_attn.k_proj.weight": ("BF16", (48, 64))},
        ),
        Layout(4),
        (L0 + "self_attn.k_proj.weight",),
        ShardingError,
        ("num_key_value_heads=6", "world_size 4", "not divisible"),
    ),
    (
        change(
            "llama",
            {"num_attention_heads": 24, "num_key_value_heads": 6, "head_dim": 8},
            {L0 + "self_attn.v_proj.bias": ("BF16", (48,))},
        ),
        Layout(8),
        (L0 + "self_attn.v_proj.bias",),
        ShardingError,
        ("v_proj.bias", "world_size 8", "num_key_value_heads=6", "not a multiple"),
    ),
    (
        change("llama", {"vocab_size": 250}, {"model.embed_tokens.weight": ("BF16", (250, 64))}),
        Layout(4),
        ("model.embed_tokens.weight",),
        ShardingError,
        ("dim 0 of size 250", "world_size 4"),
    ),
    (
        change("llama", specs_over={L0 + "mlp.down_proj.weight": ("BF16", (64, 100))}),
        Layout(8),
        (L0 + "mlp.down_proj.weight",),
        ShardingError,
        ("dim 1 of size 100", "world_size 8"),
    ),
    (
        change("llama", specs_over={L0 + "mlp.down_proj.weight": ("BF16", (64,))}),
        Layout(2),
        (L0 + "mlp.down_proj.weight",),
        ShardingError,
        ("[64]", "dim 1", "lacks"),
    ),
    (
        change("llama", specs_over={L0 + "self_attn.q_proj.weight": ("BF16", (48, 64))}),
        Layout(2),
        (L0 + "self_attn.q_proj.weight",),
        ShardingError,
        ("[48, 64]", "num_attention_heads=8 x head_dim=8", "dim 0"),
    ),
    (
        change("phi3", specs_over={L0 + "self_attn.qkv_proj.weight": ("BF16", (100, 64))}),
        Layout(2),
        (L0 + "self_attn.qkv_proj.weight",),
        ShardingError,
        ("qkv_proj.weight", "[100, 64]", "num_key_value_heads=2"),
    ),
    (
        change("phi3", specs_over={L0 + "mlp.gate_up_proj.weight": ("BF16", (129, 64))}),
        Layout(2),
        (L0 + "mlp.gate_up_proj.weight",),
        ShardingError,
        ("gate_up_proj", "2 equal fused parts"),
    ),
    (
        change("phi3", specs_over={L0 + "mlp.gate_up_proj.weight": ("BF16", (12, 64))}),
        Layout(4),
        (L0 + "mlp.gate_up_proj.weight",),
        ShardingError,
        ("fused parts has size 6", "world_size 4"),
    ),
    (
        change(
            "llama", specs_over={"model.embed_tokens.weight": ("F4", (6, 3))}
        ),  # 3 rows of 3 F4 = 36 bits per rank
        Layout(2),
        ("model.embed_tokens.weight",),
        ShardingError,
        ("embed_tokens", "F4", "cuts through a byte"),
    ),
    # --- pipeline stages
    ("llama", Layout(pp_size=4), (), ShardingError, ("pp_size 4 exceeds num_hidden_layers=3",)),
    (
        "llama",
        Layout(pp_size=2, pp_layers=(1, 1)),
        (),
        ShardingError,
        ("pp_layers [1, 1] sums to 2", "num_hidden_layers=3"),
    ),
    (
        change("llama", {"num_hidden_layers": None}),
        Layout(pp_size=2),
        (),
        ShardingError,
        ("no layer count", "pp_size 2"),
    ),
    (
        change("llama", specs_over={"model.layers.7.input_layernorm.weight": ("BF16", (64,))}),
        Layout(pp_size=2),
        (),
        ShardingError,
        ("layers.7", "layer 7", "num_hidden_layers=3"),
    ),
    # --- experts
    ("mixtral", Layout(ep_size=3), (), ShardingError, ("num_experts=4", "ep_size 3")),
    ("llama", Layout(ep_size=2), (), ShardingError, ("has no experts", "ep_size must be 1")),
    (
        change(
            "mixtral", specs_over={L0 + "block_sparse_moe.experts.9.w1.weight": ("BF16", (64, 64))}
        ),
        Layout(ep_size=2),
        (),
        ShardingError,
        ("experts.9", "expert 9", "num_experts=4"),
    ),
    (
        change("stacked-experts", specs_over={L0 + "mlp.experts.down_proj": ("BF16", (3, 64, 64))}),
        Layout(ep_size=2),
        (L0 + "mlp.experts.down_proj",),
        ShardingError,
        ("mlp.experts.down_proj", "[3, 64, 64]", "4 experts"),
    ),
    (
        change("qwen2-moe", specs_over={L0 + "mlp.experts.0.gate_proj.weight": ("BF16", (30, 64))}),
        Layout(4),
        (L0 + "mlp.experts.0.gate_proj.weight",),
        ShardingError,
        ("experts.0.gate_proj", "dim 0 of size 30", "world_size 4"),
    ),
    # --- config fields the bound rules need
    (
        change("llama", {"num_attention_heads": "8"}),
        Layout(2),
        (),
        ConfigError,
        ("num_attention_heads", "'8'"),
    ),
    (
        change("mixtral", {"num_local_experts": 0}),
        Layout(2),
        (),
        ConfigError,
        ("num_local_experts", "0"),
    ),
    (
        change(
            "llama", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}
        ),
        Layout(2),
        (),
        ConfigError,
        ("weight_block_size",),
    ),
]


def _id(case: tuple[Any, ...]) -> str:
    base = case[0] if isinstance(case[0], str) else "changed"
    return f"{base}-{case[3].__name__}-{case[4][0]}"[:80]


@pytest.mark.parametrize(
    ("source", "layout", "names", "error", "needles"), CASES, ids=map(_id, CASES)
)
def test_plan_refused(
    source: str | Callable[[], tuple[dict[str, Any], dict[str, Spec]]],
    layout: Layout,
    names: tuple[str, ...],
    error: type[WeightdError],
    needles: tuple[str, ...],
) -> None:
    c, s = variant(source) if isinstance(source, str) else source()
    with pytest.raises(error) as info:
        fake = fake_checkpoint(c, s)
        plan(fake.ckpt, rules_for(c), layout, names)
    assert type(info.value) is error or isinstance(info.value, error)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_an_unsplittable_tensor_elsewhere_does_not_fail_a_named_fetch() -> None:
    """Only the named tensors are cut (the layout and rule matching are still whole-model)."""
    c = config("LlamaForCausalLM", "llama", vocab_size=250)
    s = llama(c)
    fake = fake_checkpoint(c, s)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [x.name for x in plan(fake.ckpt, rules_for(c), Layout(4), (q,)).slices] == [q]
    with pytest.raises(ShardingError, match="embed_tokens"):
        plan(fake.ckpt, rules_for(c), Layout(4))
