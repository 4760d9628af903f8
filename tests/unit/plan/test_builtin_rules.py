"""The built-in llama-family rules (``plan.builtin_rules``): the rule table and ``rules_for``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.plan.fake_llama import fake_checkpoint, llama_config, llama_specs
from weightd.server.base.errors import ConfigError
from weightd.server.plan.builtin_rules import LLAMA_FAMILY_RULES, rules_for
from weightd.server.plan.planner import plan_rank
from weightd.server.plan.rules import AttentionShape, Split

# --- the rule table -------------------------------------------------------------------

ALL_OPTIONS = {
    "qkv_bias": True,
    "qk_norm": True,
    "out_bias": True,
    "mlp_bias": True,
    "inv_freq": True,
}
RULE_TABLE = [
    # suffix, Split, shape at world_size 2 (hidden 64, 8 heads x 16, 2 kv heads), split dim
    ("model.embed_tokens.weight", Split.VOCAB, (128, 64), 0),
    ("lm_head.weight", Split.VOCAB, (128, 64), 0),
    ("model.norm.weight", Split.REPLICATED, (64,), None),
    ("model.layers.1.input_layernorm.weight", Split.REPLICATED, (64,), None),
    ("model.layers.1.post_attention_layernorm.weight", Split.REPLICATED, (64,), None),
    ("model.layers.1.self_attn.q_proj.weight", Split.Q_HEADS, (64, 64), 0),
    ("model.layers.1.self_attn.q_proj.bias", Split.Q_HEADS, (64,), 0),
    ("model.layers.1.self_attn.k_proj.weight", Split.KV_HEADS, (16, 64), 0),
    ("model.layers.1.self_attn.k_proj.bias", Split.KV_HEADS, (16,), 0),
    ("model.layers.1.self_attn.v_proj.weight", Split.KV_HEADS, (16, 64), 0),
    ("model.layers.1.self_attn.v_proj.bias", Split.KV_HEADS, (16,), 0),
    ("model.layers.1.self_attn.o_proj.weight", Split.O_HEADS, (64, 64), 1),
    ("model.layers.1.self_attn.o_proj.bias", Split.REPLICATED, (64,), None),
    ("model.layers.1.self_attn.q_norm.weight", Split.REPLICATED, (16,), None),
    ("model.layers.1.self_attn.k_norm.weight", Split.REPLICATED, (16,), None),
    ("model.layers.1.self_attn.rotary_emb.inv_freq", Split.REPLICATED, (8,), None),
    ("model.layers.1.mlp.gate_proj.weight", Split.COLUMN, (64, 64), 0),
    ("model.layers.1.mlp.gate_proj.bias", Split.COLUMN, (64,), 0),
    ("model.layers.1.mlp.up_proj.weight", Split.COLUMN, (64, 64), 0),
    ("model.layers.1.mlp.up_proj.bias", Split.COLUMN, (64,), 0),
    ("model.layers.1.mlp.down_proj.weight", Split.ROW, (64, 64), 1),
    ("model.layers.1.mlp.down_proj.bias", Split.REPLICATED, (64,), None),
]


@pytest.mark.parametrize(
    ("name", "split", "shape", "dim"), RULE_TABLE, ids=[r[0] for r in RULE_TABLE]
)
def test_rule_table(name: str, split: Split, shape: tuple[int, ...], dim: int | None) -> None:
    config = llama_config("Qwen3ForCausalLM", kv=2, head_dim=16)
    fake = fake_checkpoint(config, llama_specs(config, **ALL_OPTIONS))
    rules = rules_for(config)
    assert rules is not None
    assert rules.split_for(name) is split
    for rank in range(2):
        (s,) = plan_rank(fake.ckpt, rules, 2, rank, (name,)).slices
        assert s.shape == shape
        assert s.replicated == (dim is None)
        full = fake.array(name)
        if dim is None:
            want = full
            assert s.pattern.count == 1
            assert list(s.pattern.ranges()) == [(fake.ckpt.tensors[name].offset, full.nbytes)]
        else:
            assert s.split_dim == dim
            n = full.shape[dim] // 2
            want = full.take(range(rank * n, (rank + 1) * n), axis=dim)
        assert fake.gather(s.shard, s.pattern) == want.tobytes()


def test_unknown_names_match_no_rule() -> None:
    rules = rules_for(llama_config())
    assert rules is not None
    for name in (
        "model.layers.0.mlp.experts.0.w1.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.q_proj.weight.extra",
        "lm_head.bias",
    ):
        assert rules.split_for(name) is None, name


def test_llama_family_table_uses_every_unfused_split_kind() -> None:
    # The fused kinds belong to Phi-3 style tables (tests/layouts covers them).
    assert {r.split for r in LLAMA_FAMILY_RULES} == set(Split) - {Split.QKV_HEADS, Split.FUSED}


# --- rules_for ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
)
def test_rules_for_llama_family_architectures(arch: str) -> None:
    rules = rules_for(llama_config(arch, heads=8, kv=2, head_dim=16))
    assert rules is not None
    assert rules.family == "llama"
    assert rules.rules == LLAMA_FAMILY_RULES
    assert rules.attention == AttentionShape(8, 2, 16)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_rules_for_model_type_fallback(model_type: str) -> None:
    config = {"model_type": model_type, "num_attention_heads": 4, "hidden_size": 32}
    rules = rules_for(config)
    assert rules is not None
    assert rules.attention == AttentionShape(4, 4, 8)  # kv defaults to heads, head_dim to h/n
    assert rules_for({**config, "architectures": []}) == rules


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["GPT2LMHeadModel"]},
        {"architectures": ["LlamaModel"]},
        {"architectures": ["PhiForCausalLM"], "model_type": "phi"},
        {"model_type": "gpt2"},
        {"model_type": "llama4"},
        {},
    ],
    ids=["gpt2", "llama-base-model", "phi", "model-type-gpt2", "llama4", "empty"],
)
def test_rules_for_other_architectures_is_none(config: dict[str, Any]) -> None:
    assert rules_for(config) is None


def test_rules_for_null_optional_fields_use_defaults() -> None:
    base = llama_config(heads=8, kv=2, head_dim=None, hidden=64)
    assert rules_for({**base, "head_dim": None}).attention == AttentionShape(8, 2, 8)
    assert rules_for({**base, "num_key_value_heads": None}).attention == AttentionShape(8, 8, 8)
    del base["num_key_value_heads"]
    assert rules_for(base).attention == AttentionShape(8, 8, 8)


DELETE = object()
BAD_CONFIGS = [
    pytest.param({"num_attention_heads": DELETE}, "num_attention_heads", id="heads-missing"),
    pytest.param({"num_attention_heads": None}, "num_attention_heads", id="heads-null"),
    pytest.param({"num_attention_heads": 0}, "num_attention_heads", id="heads-zero"),
    pytest.param({"num_attention_heads": -8}, "num_attention_heads", id="heads-negative"),
    pytest.param({"num_attention_heads": "8"}, "num_attention_heads", id="heads-string"),
    pytest.param({"num_attention_heads": 8.0}, "num_attention_heads", id="heads-float"),
    pytest.param({"num_attention_heads": True}, "num_attention_heads", id="heads-bool"),
    pytest.param({"num_key_value_heads": 0}, "num_key_value_heads", id="kv-zero"),
    pytest.param({"num_key_value_heads": 2.5}, "num_key_value_heads", id="kv-float"),
    pytest.param({"hidden_size": DELETE}, "hidden_size", id="hidden-missing"),
    pytest.param({"hidden_size": "64"}, "hidden_size", id="hidden-string"),
    pytest.param({"head_dim": 0}, "head_dim", id="head-dim-zero"),
    pytest.param({"head_dim": -1}, "head_dim", id="head-dim-negative"),
    pytest.param({"hidden_size": 60}, "head_dim", id="head-dim-not-derivable"),
    pytest.param({"num_key_value_heads": 3}, "num_key_value_heads=3", id="heads-not-multiple"),
    pytest.param({"num_key_value_heads": 16}, "num_key_value_heads=16", id="kv-above-heads"),
]


@pytest.mark.parametrize(("change", "field"), BAD_CONFIGS)
def test_rules_for_bad_config_is_config_error_naming_the_field(
    change: dict[str, Any], field: str
) -> None:
    config = {**llama_config(heads=8, kv=2, head_dim=None, hidden=64), **change}
    config = {k: v for k, v in config.items() if v is not DELETE}
    with pytest.raises(ConfigError) as info:
        rules_for(config)
    assert field in str(info.value)
    assert str(info.value).startswith("config.json: ")
