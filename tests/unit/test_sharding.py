"""Tensor-parallel rules and rank plans, checked against plain numpy slicing.

Checkpoints are built in memory (``Checkpoint``/``TensorInfo`` with made-up offsets)
over a fake byte buffer per shard, so a plan's run pattern can be gathered from the
buffer and compared with the slice numpy cuts from the same bytes. The expected
slices are restated here from the rules' prose, not from weightd's rule table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from weightd.common.dtypes import DTYPE_BITS
from weightd.server.base.errors import (
    ConfigError,
    InvalidRequest,
    NoShardingRules,
    ShardingError,
    TensorNotFound,
)
from weightd.server.checkpoint.description import Checkpoint, TensorInfo
from weightd.server.plan.builtin_rules import LLAMA_FAMILY_RULES, rules_for
from weightd.server.plan.planner import plan_rank
from weightd.server.plan.rules import ArchRules, AttentionShape, Split
from weightd.server.plan.slices import slice_tensor
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


def test_unknown_tensor_fails_the_whole_plan_not_just_a_filtered_one() -> None:
    config = llama_config()
    specs = llama_specs(config)
    specs["model.layers.0.mlp.router.weight"] = ("BF16", (4, 64))
    fake = fake_checkpoint(config, specs)
    with pytest.raises(ShardingError, match=r"router\.weight"):
        plan_rank(fake.ckpt, rules_for(config), 2, 1)


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
