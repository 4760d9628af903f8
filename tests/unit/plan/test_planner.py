"""Rank plans (``weightd.server.plan.planner``), checked against plain numpy slicing.

Checkpoints are fakes built in memory (``tests/unit/plan/fake_llama.py``), so a plan's
run pattern can be gathered from the fake bytes and compared with the slice numpy cuts
from the same bytes. The expected slices are restated here from the rules' prose, not
from weightd's rule table.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.unit.plan.fake_llama import Fake, Spec, fake_checkpoint, llama_config, llama_specs
from weightd.server.base.errors import (
    InvalidRequest,
    NoShardingRules,
    ShardingError,
    TensorNotFound,
)
from weightd.server.plan.builtin_rules import rules_for
from weightd.server.plan.planner import plan_rank
from weightd.server.plan.rules import ArchRules

# --- the rules, restated independently ------------------------------------------------

KIND_BY_SUFFIX = (
    ("self_attn.q_proj.weight", "q"),
    ("self_attn.q_proj.bias", "q"),
    ("self_attn.k_proj.weight", "kv"),
    ("self_attn.k_proj.bias", "kv"),
    ("self_attn.v_proj.weight", "kv"),
    ("self_attn.v_proj.bias", "kv"),
    ("self_attn.o_proj.weight", "row"),
    ("self_attn.o_proj.bias", "replicated"),
    ("mlp.gate_proj.weight", "column"),
    ("mlp.gate_proj.bias", "column"),
    ("mlp.up_proj.weight", "column"),
    ("mlp.up_proj.bias", "column"),
    ("mlp.down_proj.weight", "row"),
    ("mlp.down_proj.bias", "replicated"),
    ("embed_tokens.weight", "column"),  # vocab-parallel: dim 0
    ("lm_head.weight", "column"),
    ("norm.weight", "replicated"),
    ("rotary_emb.inv_freq", "replicated"),
)


def kind_of(name: str) -> str:
    for suffix, kind in KIND_BY_SUFFIX:
        if name.endswith(suffix):
            return kind
    raise AssertionError(f"test bug: no expectation for {name}")


def expected_slice(
    name: str, a: np.ndarray, kv: int, hd: int, ws: int, rank: int
) -> tuple[np.ndarray, int | None]:
    """(the rank's slice, its split dim or None when replicated)."""
    kind = kind_of(name)
    if ws == 1 or kind == "replicated":
        return a, None
    if kind == "kv":
        if ws <= kv:
            n = a.shape[0] // ws
            return a[rank * n : (rank + 1) * n], 0
        head = rank // (ws // kv)
        return a[head * hd : (head + 1) * hd], 0
    if kind in ("q", "column"):
        n = a.shape[0] // ws
        return a[rank * n : (rank + 1) * n], 0
    n = a.shape[1] // ws
    return a[:, rank * n : (rank + 1) * n], 1


VARIANTS = {
    "llama-gqa2-explicit-head-dim": (
        llama_config("LlamaForCausalLM", kv=2, head_dim=16),
        {"inv_freq": True},
    ),
    "llama-gqa4-derived-head-dim-tied-f32": (
        llama_config("LlamaForCausalLM", kv=4, head_dim=None),
        {"dtype": "F32", "tied": True},
    ),
    "mistral-mha": (llama_config("MistralForCausalLM", kv=8, head_dim=8), {"dtype": "F16"}),
    "qwen2-biases": (
        llama_config("Qwen2ForCausalLM", kv=2, head_dim=8),
        {"qkv_bias": True, "out_bias": True, "mlp_bias": True},
    ),
    "qwen3-qk-norm": (
        llama_config("Qwen3ForCausalLM", kv=4, head_dim=16),
        {"qk_norm": True},
    ),
}


def variant(key: str, shards: int = 2) -> tuple[Fake, ArchRules, int, int]:
    config, flags = VARIANTS[key]
    fake = fake_checkpoint(config, llama_specs(config, **flags), shards=shards)
    rules = rules_for(config)
    assert rules is not None
    assert rules.attention is not None
    return fake, rules, rules.attention.num_kv_heads, rules.attention.head_dim


@pytest.mark.parametrize("ws", [1, 2, 4, 8])
@pytest.mark.parametrize("key", sorted(VARIANTS))
def test_every_tensor_of_every_rank_matches_numpy(key: str, ws: int) -> None:
    fake, rules, kv, hd = variant(key)
    ckpt = fake.ckpt
    for rank in range(ws):
        plan = plan_rank(ckpt, rules, ws, rank)
        assert (plan.model, plan.world_size, plan.rank) == ("tiny", ws, rank)
        assert [s.name for s in plan.slices] == list(ckpt.tensors)
        total = 0
        for s in plan.slices:
            t = ckpt.tensors[s.name]
            want, dim = expected_slice(s.name, fake.array(s.name), kv, hd, ws, rank)
            assert s.dtype == t.dtype
            assert s.shard == t.shard
            assert s.full_shape == t.shape
            assert s.shape == want.shape, s.name
            assert s.replicated == (dim is None), s.name
            if dim is not None:
                assert s.split_dim == dim, s.name
            assert s.nbytes == want.nbytes, s.name
            assert fake.gather(s.shard, s.pattern) == want.tobytes(), s.name
            total += s.nbytes
        assert plan.nbytes == total


@pytest.mark.parametrize("ws", [2, 4])
def test_sharded_slices_tile_the_tensor(ws: int) -> None:
    """Across ranks, the non-kv split slices concatenate back to the whole tensor."""
    fake, rules, _, _ = variant("qwen2-biases")
    plans = [plan_rank(fake.ckpt, rules, ws, r) for r in range(ws)]
    for i, name in enumerate(fake.ckpt.tensors):
        parts = [p.slices[i] for p in plans]
        if parts[0].replicated or kind_of(name) == "kv":
            continue
        dt = fake.array(name).dtype
        arrays = [
            np.frombuffer(fake.gather(s.shard, s.pattern), dt).reshape(s.shape) for s in parts
        ]
        whole = np.concatenate(arrays, axis=parts[0].split_dim)
        assert whole.tobytes() == fake.array(name).tobytes(), name


# --- world size 1 ----------------------------------------------------------------------


def test_world_size_one_serves_any_architecture_whole() -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    specs: dict[str, Spec] = {
        "transformer.wte.weight": ("F32", (50, 8)),
        "transformer.h.0.attn.c_attn.weight": ("F16", (8, 24)),
        "transformer.h.0.attn.c_attn.bias": ("F16", (24,)),
        "transformer.ln_f.weight": ("F32", (8,)),
        "scale": ("F64", ()),
        "empty": ("F32", (0, 3)),
    }
    fake = fake_checkpoint(config, specs, shards=2)
    assert rules_for(config) is None
    plan = plan_rank(fake.ckpt, None, 1, 0)
    assert [s.name for s in plan.slices] == list(fake.ckpt.tensors)
    for s in plan.slices:
        t = fake.ckpt.tensors[s.name]
        assert s.replicated
        assert s.shape == s.full_shape == t.shape
        assert fake.gather(s.shard, s.pattern) == fake.array(s.name).tobytes()
    assert plan.nbytes == fake.ckpt.total_bytes


def test_world_size_one_serves_unknown_llama_tensors_whole() -> None:
    config = llama_config()
    specs = llama_specs(config)
    specs["model.layers.0.mlp.experts.0.w1.weight"] = ("BF16", (3, 5))
    fake = fake_checkpoint(config, specs)
    plan = plan_rank(fake.ckpt, rules_for(config), 1, 0)
    assert all(s.replicated and s.shape == s.full_shape for s in plan.slices)
    assert plan.nbytes == fake.ckpt.total_bytes


def test_names_filter_keeps_request_order() -> None:
    fake, rules, _, _ = variant("qwen3-qk-norm")
    names = ("lm_head.weight", "model.layers.1.self_attn.q_norm.weight", "model.norm.weight")
    plan = plan_rank(fake.ckpt, rules, 4, 3, names)
    assert tuple(s.name for s in plan.slices) == names


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ws", "rank"), [(2, 2), (2, -1), (1, 1), (0, 0), (-1, 0), (4, 100)], ids=str
)
def test_bad_layout_is_invalid_request(ws: int, rank: int) -> None:
    fake, rules, _, _ = variant("qwen3-qk-norm")
    with pytest.raises(InvalidRequest) as info:
        plan_rank(fake.ckpt, rules, ws, rank)
    assert str(ws) in str(info.value)


def test_unknown_tensor_fails_the_whole_plan_not_just_a_filtered_one() -> None:
    config = llama_config()
    specs = llama_specs(config)
    specs["model.layers.0.mlp.router.weight"] = ("BF16", (4, 64))
    fake = fake_checkpoint(config, specs)
    with pytest.raises(ShardingError, match=r"router\.weight"):
        plan_rank(fake.ckpt, rules_for(config), 2, 1)


@pytest.mark.parametrize(
    ("config", "label"),
    [
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        ({"model_type": "gpt_neox"}, "gpt_neox"),
        ({}, "unknown"),
        ({"architectures": ["PhiForCausalLM"], "model_type": "llama"}, "PhiForCausalLM"),
    ],
    ids=["architecture", "model-type", "nothing", "architecture-wins"],
)
def test_unknown_architecture_is_refused_past_world_size_one(
    config: dict[str, Any], label: str
) -> None:
    specs: dict[str, Spec] = {"w": ("F32", (4, 4)), "b": ("F32", (4,))}
    fake = fake_checkpoint(config, specs)
    rules = rules_for(config)
    assert rules is None
    with pytest.raises(NoShardingRules) as info:
        plan_rank(fake.ckpt, rules, 2, 0)
    assert repr(label) in str(info.value)
    assert "asked for 2" in str(info.value)
    assert len(plan_rank(fake.ckpt, rules, 1, 0).slices) == 2


def test_names_filter_unknown_name_is_tensor_not_found() -> None:
    fake, rules, _, _ = variant("qwen3-qk-norm")
    with pytest.raises(TensorNotFound) as info:
        plan_rank(fake.ckpt, rules, 2, 0, ("model.norm.weight", "model.nope.weight"))
    assert "'model.nope.weight'" in str(info.value)
    assert "'tiny'" in str(info.value)


def test_names_filter_duplicate_is_invalid_request() -> None:
    fake, rules, _, _ = variant("qwen3-qk-norm")
    with pytest.raises(InvalidRequest) as info:
        plan_rank(fake.ckpt, rules, 1, 0, ("model.norm.weight", "model.norm.weight"))
    assert "'model.norm.weight'" in str(info.value)
