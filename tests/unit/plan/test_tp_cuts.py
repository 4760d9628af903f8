"""Tensor-parallel cuts of single tensors (``plan.tpcut``, ``plan.slices``), through the planner.

GQA key/value heads, sizes that do not divide by the world size and the messages that
say so, ``slice_tensor`` for each split, and sub-byte rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from tests.unit.plan.fake_llama import Spec, fake_checkpoint, llama_config, llama_specs
from weightd.common.dtypes import DTYPE_BITS
from weightd.server.base.errors import ShardingError
from weightd.server.checkpoint.description import TensorInfo
from weightd.server.plan.builtin_rules import LLAMA_FAMILY_RULES, rules_for
from weightd.server.plan.planner import plan_rank
from weightd.server.plan.rules import ArchRules, AttentionShape, Split
from weightd.server.plan.slices import slice_tensor

# --- GQA -------------------------------------------------------------------------------


@pytest.mark.parametrize(("kv", "ws"), [(2, 4), (2, 8), (4, 8), (1, 2), (1, 8)])
def test_gqa_ranks_past_kv_heads_get_their_kv_head(kv: int, ws: int) -> None:
    config = llama_config(kv=kv, head_dim=16)
    fake = fake_checkpoint(config, llama_specs(config, qkv_bias=True))
    rules = rules_for(config)
    hd = 16
    for rank in range(ws):
        head = rank // (ws // kv)
        for proj in ("k_proj", "v_proj"):
            for suffix in ("weight", "bias"):
                name = f"model.layers.0.self_attn.{proj}.{suffix}"
                (s,) = plan_rank(fake.ckpt, rules, ws, rank, (name,)).slices
                full = fake.array(name)
                want = full[head * hd : (head + 1) * hd]
                assert s.shape == want.shape == (hd, *full.shape[1:])
                assert fake.gather(s.shard, s.pattern) == want.tobytes()
                row_bytes = full.nbytes // full.shape[0]
                t = fake.ckpt.tensors[name]
                assert list(s.pattern.ranges()) == [
                    (t.offset + head * hd * row_bytes, hd * row_bytes)
                ]


def test_gqa_query_heads_stay_with_their_kv_head() -> None:
    """Rank r's query heads attend with the kv head it receives (GQA grouping)."""
    heads, kv, hd, ws = 8, 2, 16, 8
    config = llama_config(heads=heads, kv=kv, head_dim=hd)
    fake = fake_checkpoint(config, llama_specs(config))
    rules = rules_for(config)
    head_bytes = hd * 64 * 2  # head_dim rows of hidden=64 BF16 values
    names = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight")
    for rank in range(ws):
        q, k = plan_rank(fake.ckpt, rules, ws, rank, names).slices
        ((q_off, q_len),) = q.pattern.ranges()
        ((k_off, k_len),) = k.pattern.ranges()
        q_heads = range(
            (q_off - fake.ckpt.tensors[q.name].offset) // head_bytes,
            (q_off - fake.ckpt.tensors[q.name].offset + q_len) // head_bytes,
        )
        k_head = (k_off - fake.ckpt.tensors[k.name].offset) // head_bytes
        assert len(q_heads) == heads // ws
        assert k_len == head_bytes
        assert {h // (heads // kv) for h in q_heads} == {k_head}


# --- sizes that do not divide, shapes that disagree with the config -------------------


def _one(config: dict[str, Any], specs: Mapping[str, Spec], name: str, ws: int) -> None:
    fake = fake_checkpoint(config, specs)
    plan_rank(fake.ckpt, rules_for(config), ws, 0, (name,))


ERRORS = [
    pytest.param(
        llama_config(),
        None,
        "model.layers.0.self_attn.q_proj.weight",
        3,
        ("q_proj.weight", "num_attention_heads=8", "world_size 3"),
        id="heads-not-divisible",
    ),
    pytest.param(
        llama_config(),
        None,
        "model.layers.0.self_attn.o_proj.weight",
        16,
        ("o_proj.weight", "num_attention_heads=8", "world_size 16"),
        id="o-proj-heads-not-divisible",
    ),
    pytest.param(
        llama_config(),
        None,
        "model.layers.0.self_attn.k_proj.weight",
        3,
        ("k_proj.weight", "num_attention_heads=8", "world_size 3"),
        id="kv-split-checks-query-heads",
    ),
    pytest.param(
        llama_config(heads=24, kv=6, head_dim=4, hidden=96),
        None,
        "model.layers.0.self_attn.k_proj.weight",
        4,
        ("k_proj.weight", "num_key_value_heads=6", "world_size 4"),
        id="kv-heads-not-divisible",
    ),
    pytest.param(
        llama_config(heads=24, kv=6, head_dim=4, hidden=96),
        None,
        "model.layers.0.self_attn.v_proj.bias",
        8,
        ("v_proj.bias", "world_size 8", "num_key_value_heads=6", "not a multiple"),
        id="ws-not-multiple-of-kv-heads",
    ),
    pytest.param(
        llama_config(vocab=250),
        None,
        "model.embed_tokens.weight",
        4,
        ("embed_tokens.weight", "250", "world_size 4"),
        id="vocab-not-divisible",
    ),
    pytest.param(
        llama_config(vocab=250),
        None,
        "lm_head.weight",
        4,
        ("lm_head.weight", "250", "world_size 4"),
        id="lm-head-not-divisible",
    ),
    pytest.param(
        llama_config(inter=100),
        None,
        "model.layers.1.mlp.down_proj.weight",
        8,
        ("down_proj.weight", "dim 1", "100", "world_size 8"),
        id="intermediate-not-divisible",
    ),
    pytest.param(
        llama_config(inter=100),
        None,
        "model.layers.1.mlp.gate_proj.weight",
        8,
        ("gate_proj.weight", "dim 0", "100", "world_size 8"),
        id="gate-not-divisible",
    ),
    pytest.param(
        llama_config(),
        {"model.layers.0.self_attn.q_proj.weight": ("BF16", (64, 64))},
        "model.layers.0.self_attn.q_proj.weight",
        2,
        ("q_proj.weight", "[64, 64]", "num_attention_heads=8", "head_dim=16"),
        id="q-shape-disagrees-with-config",
    ),
    pytest.param(
        llama_config(),
        {"model.layers.0.self_attn.k_proj.weight": ("BF16", (48, 64))},
        "model.layers.0.self_attn.k_proj.weight",
        2,
        ("k_proj.weight", "[48, 64]", "num_key_value_heads=2"),
        id="kv-shape-disagrees-with-config",
    ),
    pytest.param(
        llama_config(),
        {"model.layers.0.self_attn.o_proj.weight": ("BF16", (64, 64))},
        "model.layers.0.self_attn.o_proj.weight",
        2,
        ("o_proj.weight", "[64, 64]", "dim 1"),
        id="o-shape-disagrees-with-config",
    ),
    pytest.param(
        llama_config(),
        {"model.layers.0.mlp.down_proj.weight": ("BF16", (64,))},
        "model.layers.0.mlp.down_proj.weight",
        2,
        ("down_proj.weight", "[64]", "dim 1", "lacks"),
        id="row-split-of-1d-tensor",
    ),
    pytest.param(
        llama_config(),
        {"model.layers.0.mlp.experts.0.w1.weight": ("BF16", (8, 8))},
        "model.layers.0.mlp.experts.0.w1.weight",
        2,
        ("experts.0.w1.weight", "llama-family", "world_size 2"),
        id="unknown-tensor-name",
    ),
]


@pytest.mark.parametrize(("config", "override", "name", "ws", "needles"), ERRORS)
def test_sharding_errors_name_the_tensor_and_sizes(
    config: dict[str, Any],
    override: Mapping[str, Spec] | None,
    name: str,
    ws: int,
    needles: tuple[str, ...],
) -> None:
    specs = {**llama_specs(config, qkv_bias=True), **(override or {})}
    with pytest.raises(ShardingError) as info:
        _one(config, specs, name, ws)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_kv_heads_replicate_at_multiples_of_kv() -> None:
    config = llama_config(heads=24, kv=6, head_dim=4, hidden=96)
    fake = fake_checkpoint(config, llama_specs(config))
    name = "model.layers.0.self_attn.v_proj.weight"
    for ws in (12, 24):
        for rank in range(ws):
            (s,) = plan_rank(fake.ckpt, rules_for(config), ws, rank, (name,)).slices
            head = rank // (ws // 6)
            want = fake.array(name)[head * 4 : head * 4 + 4]
            assert fake.gather(s.shard, s.pattern) == want.tobytes()


def test_head_split_without_attention_shape_is_sharding_error() -> None:
    t = TensorInfo("model.layers.0.self_attn.q_proj.weight", "F32", (8, 8), "s", 0, 256)
    with pytest.raises(ShardingError, match="q_proj"):
        slice_tensor(t, Split.Q_HEADS, None, 2, 0)
    no_att = ArchRules("llama", LLAMA_FAMILY_RULES, None)
    with pytest.raises(ShardingError, match="head counts"):
        slice_tensor(t, Split.KV_HEADS, no_att, 2, 0)


def test_slice_tensor_directly_for_each_split() -> None:
    t = TensorInfo("x", "F32", (8, 16), "s", 1000, 8 * 16 * 4)
    rules = ArchRules("llama", LLAMA_FAMILY_RULES, AttentionShape(4, 2, 4))
    col = slice_tensor(t, Split.COLUMN, rules, 4, 3)
    assert (col.shape, col.split_dim, col.replicated) == ((2, 16), 0, False)
    assert list(col.pattern.ranges()) == [(1000 + 6 * 64, 2 * 64)]
    row = slice_tensor(t, Split.ROW, rules, 4, 1)
    assert (row.shape, row.split_dim) == ((8, 4), 1)
    assert list(row.pattern.ranges()) == [(1000 + i * 64 + 16, 16) for i in range(8)]
    rep = slice_tensor(t, Split.REPLICATED, rules, 4, 2)
    assert rep.replicated
    assert list(rep.pattern.ranges()) == [(1000, 512)]
    kv_t = TensorInfo("k", "F32", (8, 16), "s", 0, 512)  # 2 kv heads x head_dim 4
    kv = slice_tensor(kv_t, Split.KV_HEADS, rules, 4, 3)  # 4 ranks > 2 kv heads: head 1
    assert list(kv.pattern.ranges()) == [(4 * 64, 4 * 64)]


# --- a bug ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["F4", "F6_E2M3"])
def test_sub_byte_row_split_is_served_or_refused_with_sharding_error(dtype: str) -> None:
    config = llama_config()
    specs = llama_specs(config)
    name = "model.layers.0.mlp.down_proj.weight"
    specs[name] = (dtype, (64, 128))  # rows of 128 elements: 64 or 96 bytes
    fake = fake_checkpoint(config, specs)
    bits = DTYPE_BITS[dtype]
    try:
        plan = plan_rank(fake.ckpt, rules_for(config), 2, 1, (name,))
    except ShardingError as exc:
        assert name in str(exc)
        return
    (s,) = plan.slices
    t = fake.ckpt.tensors[name]
    row = 128 * bits // 8
    half = row // 2
    assert s.shape == (64, 64)
    assert list(s.pattern.ranges()) == [(t.offset + i * row + half, half) for i in range(64)]
