"""Quantized modules: slicing then dequantizing equals dequantizing then slicing.

Synthetic GPTQ, AWQ and FP8-block modules (``quantfmt``, written from the formats'
reference code) under Llama and Phi-3 names; each rank's tensors are gathered from
the plan's byte runs, dequantized with the test's own dequantizers and compared
with the restated TP cut (``restate``) of the whole module's dequantized weight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from tests.layouts import quantfmt, restate
from tests.layouts.fakes import DTYPES, Fake, fake_checkpoint
from weightd.server.base.errors import (
    ConfigError,
    QuantizationSplitError,
    ShardingError,
    UnsupportedQuantization,
    WeightdError,
)
from weightd.server.plan.builtin_rules import rules_for
from weightd.server.plan.layout import Layout
from weightd.server.plan.planner import plan
from weightd.server.plan.quant import QuantScheme, geometry, parse_quantization

DT = {
    torch.int32: "I32",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
}


def llama_config(quant: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 1,
        "quantization_config": quant,
        **over,
    }


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
GPTQ_ACT = {**GPTQ, "desc_act": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}

#: module prefix → (out, in); the name says which rule applies.
LLAMA_MODULES = {
    "model.layers.0.mlp.gate_proj": (512, 256),  # column
    "model.layers.0.mlp.down_proj": (256, 512),  # row
    "model.layers.0.self_attn.q_proj": (512, 256),  # whole query heads (8 x 64)
    "model.layers.0.self_attn.k_proj": (128, 256),  # whole kv heads (2 x 64), replicated past 2
    "model.layers.0.self_attn.o_proj": (256, 512),  # row, whole heads
}


def build(
    kind: str, config: dict[str, Any], modules: dict[str, tuple[int, int]], seed: int = 0
) -> tuple[Fake, dict[str, dict[str, torch.Tensor]]]:
    rng = np.random.default_rng(seed)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, (out, inn) in modules.items():
        group = int(config["quantization_config"].get("group_size", 128))
        if kind == "gptq":
            desc = bool(config["quantization_config"]["desc_act"])
            parts[prefix] = quantfmt.gptq_module(out, inn, group, rng, desc_act=desc)
        elif kind == "awq":
            parts[prefix] = quantfmt.awq_module(out, inn, group, rng)
        else:
            parts[prefix] = quantfmt.fp8_module(out, inn, rng)
    values = {f"{p}.{role}": t for p, m in parts.items() for role, t in m.items()}
    specs = {n: (DT[t.dtype], tuple(t.shape)) for n, t in values.items()}
    return fake_checkpoint(config, specs, values=values), parts


def dequant(kind: str, m: dict[str, torch.Tensor], config: dict[str, Any]) -> torch.Tensor:
    if kind == "gptq":
        return quantfmt.gptq_dequant(m, 128, bool(config["quantization_config"]["desc_act"]))
    if kind == "awq":
        return quantfmt.awq_dequant(m, 128)
    return quantfmt.fp8_dequant(m)


def received(fake: Fake, p: Any) -> dict[str, torch.Tensor]:
    out = {}
    for s in p.slices:
        raw = bytearray(fake.gather(s.shard, s.pattern))
        out[s.name] = torch.frombuffer(raw, dtype=DTYPES[s.dtype]).reshape(s.shape)
    return out


CASES = [
    pytest.param("gptq", GPTQ, id="gptq"),
    pytest.param("gptq", GPTQ_ACT, id="gptq-desc-act"),
    pytest.param("awq", AWQ, id="awq"),
    pytest.param("fp8", FP8, id="fp8-block"),
]


@pytest.mark.parametrize(("kind", "quant"), CASES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_slice_then_dequantize_equals_dequantize_then_slice(
    kind: str, quant: dict[str, Any], tp: int
) -> None:
    modules = dict(LLAMA_MODULES)
    if kind == "fp8" and tp > 1:  # 128x128 blocks: kv heads of 64 rows cannot be cut
        modules.pop("model.layers.0.self_attn.k_proj")
        modules["model.layers.0.mlp.up_proj"] = (512, 320)  # partial last block of columns
    config = llama_config(quant)
    fake, parts = build(kind, config, modules)
    rules = rules_for(config)
    for rank in range(tp):
        got = received(fake, plan(fake.ckpt, rules, Layout.tp(tp, rank)))
        lay = restate.L(tp, rank)
        for prefix, module in parts.items():
            full = dequant(kind, module, config)
            mine = {role: got[f"{prefix}.{role}"] for role in module}
            want = restate.expected(prefix + ".weight", full, config, lay)
            assert torch.equal(dequant(kind, mine, config), want), (prefix, tp, rank)
            if "bias" in module:
                bias = restate.expected(prefix + ".bias", module["bias"], config, lay)
                assert torch.equal(mine["bias"], bias)


@pytest.mark.parametrize("kind", ["gptq", "awq"])
@pytest.mark.parametrize("tp", [2, 4])
def test_phi3_fused_qkv_and_gate_up_quantized(kind: str, tp: int) -> None:
    quant = GPTQ if kind == "gptq" else AWQ
    config = {**llama_config(quant), "architectures": ["Phi3ForCausalLM"]}
    q, kv = 8 * 64, 2 * 64
    modules = {
        "model.layers.0.self_attn.qkv_proj": (q + 2 * kv, 256),
        "model.layers.0.mlp.gate_up_proj": (2 * 256, 256),
    }
    fake, parts = build(kind, config, modules)
    rules = rules_for(config)
    for rank in range(tp):
        got = received(fake, plan(fake.ckpt, rules, Layout.tp(tp, rank)))
        for prefix, module in parts.items():
            full = dequant(kind, module, config)
            mine = {role: got[f"{prefix}.{role}"] for role in module}
            want = restate.expected(prefix + ".weight", full, config, restate.L(tp, rank))
            assert torch.equal(dequant(kind, mine, config), want), (prefix, tp, rank)


def test_act_order_keeps_scales_whole_for_row_parallel() -> None:
    """desc_act: g_idx sends rows to any group, so a row-parallel rank gets every group."""
    config = llama_config(GPTQ_ACT)
    fake, _ = build("gptq", config, {"model.layers.0.mlp.down_proj": (256, 512)})
    p = plan(fake.ckpt, rules_for(config), Layout.tp(8, 3))
    shapes = {s.name.rsplit(".", 1)[1]: s.shape for s in p.slices}
    assert shapes == {
        "qweight": (8, 256),  # 64 input rows, 8 per word
        "qzeros": (4, 32),  # all 4 groups
        "scales": (4, 256),
        "g_idx": (64,),
        "bias": (256,),
    }


# --- rejections ------------------------------------------------------------------------

REJECT = [
    pytest.param(
        "gptq",
        GPTQ,
        {"model.layers.0.mlp.down_proj": (256, 512)},
        8,
        QuantizationSplitError,
        ("down_proj", "group_size 128", "boundary at 64", "multiples of 128"),
        id="gptq-row-cuts-group",
    ),
    pytest.param(
        "gptq",
        GPTQ,
        {"model.layers.0.mlp.gate_proj": (48, 256)},
        4,
        QuantizationSplitError,
        ("gate_proj", "packed int32 word", "8 4-bit values", "boundary at 12"),
        id="gptq-column-cuts-packed-zeros",
    ),
    pytest.param(
        "awq",
        AWQ,
        {"model.layers.0.mlp.gate_proj": (48, 256)},
        4,
        QuantizationSplitError,
        ("gate_proj.qweight", "packed int32 word", "boundary at 12"),
        id="awq-column-cuts-packed-word",
    ),
    pytest.param(
        "awq",
        AWQ,
        {"model.layers.0.mlp.down_proj": (256, 256)},
        4,
        QuantizationSplitError,
        ("down_proj", "group_size 128", "boundary at 64"),
        id="awq-row-cuts-group",
    ),
    pytest.param(
        "fp8",
        FP8,
        {"model.layers.0.mlp.gate_proj": (256, 256)},
        4,
        QuantizationSplitError,
        ("gate_proj.weight", "128x128 scale block", "boundary at 64"),
        id="fp8-column-cuts-block",
    ),
    pytest.param(
        "fp8",
        FP8,
        {"model.layers.0.self_attn.o_proj": (256, 512)},
        8,
        QuantizationSplitError,
        ("o_proj", "128x128 scale block", "input dim"),
        id="fp8-row-cuts-block",
    ),
    pytest.param(
        "gptq",
        {**GPTQ_ACT, "group_size": 32},
        {"model.layers.0.mlp.down_proj": (256, 96)},
        8,
        QuantizationSplitError,
        ("down_proj", "packed int32 word", "boundary at 12"),
        id="gptq-act-order-still-keeps-words",
    ),
    pytest.param(
        "gptq",
        {**GPTQ, "quant_method": "bitsandbytes"},
        {"model.layers.0.mlp.gate_proj": (64, 256)},
        2,
        UnsupportedQuantization,
        ("'bitsandbytes'",),
        id="unsupported-method",
    ),
    pytest.param(
        "awq",
        {**AWQ, "version": "gemv"},
        {"model.layers.0.mlp.gate_proj": (64, 256)},
        2,
        UnsupportedQuantization,
        ("'gemv'",),
        id="awq-gemv-layout",
    ),
    pytest.param(
        "gptq",
        {**GPTQ, "is_marlin_format": True},
        {"model.layers.0.mlp.gate_proj": (64, 256)},
        2,
        UnsupportedQuantization,
        ("'marlin'",),
        id="gptq-marlin-tiles",
    ),
]


@pytest.mark.parametrize(("kind", "quant", "modules", "tp", "error", "needles"), REJECT)
def test_cuts_through_words_groups_and_blocks_are_refused(
    kind: str,
    quant: dict[str, Any],
    modules: dict[str, tuple[int, int]],
    tp: int,
    error: type[WeightdError],
    needles: tuple[str, ...],
) -> None:
    config = llama_config(quant)
    fake, _ = build(kind, config, modules)
    with pytest.raises(error) as info:
        plan(fake.ckpt, rules_for(config), Layout.tp(tp, 0))
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_quantized_tensor_without_quantization_config() -> None:
    config = llama_config(GPTQ)
    fake, _ = build("gptq", config, {"model.layers.0.mlp.gate_proj": (64, 256)})
    del config["quantization_config"]
    with pytest.raises(ShardingError, match=r"gate_proj\.qweight.*no quantization_config"):
        plan(fake.ckpt, rules_for(config), Layout.tp(2, 0))


def test_scales_of_the_wrong_shape_are_named() -> None:
    config = llama_config(GPTQ)
    _fake, parts = build("gptq", config, {"model.layers.0.mlp.gate_proj": (64, 256)})
    module = parts["model.layers.0.mlp.gate_proj"]
    module["scales"] = module["scales"][:, :32].contiguous()
    values = {f"model.layers.0.mlp.gate_proj.{r}": t for r, t in module.items()}
    specs = {n: (DT[t.dtype], tuple(t.shape)) for n, t in values.items()}
    bad = fake_checkpoint(config, specs, values=values)
    with pytest.raises(ShardingError, match=r"gate_proj\.scales.*\[2, 32\].*\[2, 64\]"):
        plan(bad.ckpt, rules_for(config), Layout.tp(2, 0))


def test_quantized_checkpoint_at_tp1_pp2_needs_no_cut() -> None:
    config = {**llama_config({"quant_method": "bitsandbytes"}), "num_hidden_layers": 2}
    fake, _ = build(
        "fp8", llama_config(FP8), {f"model.layers.{i}.mlp.gate_proj": (64, 64) for i in range(2)}
    )
    fake.ckpt.config.update(config)  # type: ignore[attr-defined]
    names = {
        s.name for s in plan(fake.ckpt, rules_for(config), Layout(pp_size=2, pp_rank=1)).slices
    }
    assert names == {
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.gate_proj.weight_scale_inv",
    }


# --- the quantization config and each tensor's geometry, refused precisely ----------------

QC_BAD = [
    ([], ConfigError, "quantization_config must be an object"),
    ({"bits": 4}, ConfigError, "quant_method is None"),
    ({"quant_method": "gptq", "bits": "4"}, ConfigError, "quantization_config.bits"),
    ({"quant_method": "gptq", "bits": 4, "desc_act": "yes"}, ConfigError, "desc_act"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, ConfigError, "weight_block_size"),
]


@pytest.mark.parametrize(("qc", "error", "needle"), QC_BAD)
def test_bad_quantization_config(qc: Any, error: type[WeightdError], needle: str) -> None:
    with pytest.raises(error, match=re.escape(needle)):
        parse_quantization({"quantization_config": qc})


@pytest.mark.parametrize(
    ("qc", "problem"),
    [
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 12}, "group_size 12"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
    ],
)
def test_schemes_that_cannot_be_sliced_say_why(qc: dict[str, Any], problem: str) -> None:
    scheme = parse_quantization({"quantization_config": qc})
    assert scheme is not None and problem in scheme.problem


@dataclass
class T:
    shape: tuple[int, ...]


GPTQ4 = QuantScheme("gptq", 4, 128)
FP8B = QuantScheme("fp8", block=(128, 128))
M = "m.layers.0.mlp.gate_proj"
GEOMETRY_BAD = [
    (f"{M}.scales", (2, 64), {}, GPTQ4, "no 2-D qweight"),
    (f"{M}.scales", (2, 60), {f"{M}.qweight": T((32, 60))}, GPTQ4, "output dim 60"),
    (f"{M}.scales", (2, 64), {f"{M}.qweight": T((12, 64))}, GPTQ4, "input dim 96"),
    (f"{M}.qzeros", (2, 4), {f"{M}.qweight": T((32, 64))}, GPTQ4, "qzeros [in/group, out/8]"),
    (f"{M}.g_idx", (128,), {f"{M}.qweight": T((32, 64))}, GPTQ4, "g_idx [in] = [256]"),
    (f"{M}.bias", (32,), {f"{M}.qweight": T((32, 64))}, GPTQ4, "bias [out] = [64]"),
    (f"{M}.weight_scale_inv", (1, 1), {f"{M}.qweight": T((32, 64))}, GPTQ4, "not part of a gptq"),
    (f"{M}.weight_scale_inv", (2, 2), {}, FP8B, "no weight for its weight_scale_inv"),
    (f"{M}.weight", (4, 4, 4), {f"{M}.weight_scale_inv": T((1, 1))}, FP8B, "must be 2-D"),
    (f"{M}.weight", (256, 256), {f"{M}.weight_scale_inv": T((2, 2))}, FP8B, "is BF16"),
    (f"{M}.weight_scale_inv", (2, 3), {f"{M}.weight": T((256, 256))}, FP8B, "= [2, 2]"),
    (f"{M}.qweight", (2, 2), {f"{M}.weight": T((256, 256))}, FP8B, "not part of an fp8"),
    (f"{M}.weight_scale", (64, 2), {f"{M}.weight": T((64, 64))}, QuantScheme("fp8"), "no known"),
]


@pytest.mark.parametrize(("name", "shape", "siblings", "scheme", "needle"), GEOMETRY_BAD)
def test_tensor_geometry_refused(
    name: str, shape: tuple[int, ...], siblings: dict[str, T], scheme: QuantScheme, needle: str
) -> None:
    tensors: dict[str, Any] = {name: T(shape), **siblings}
    with pytest.raises(ShardingError) as info:
        geometry(name, "BF16", shape, tensors, scheme)
    assert f"tensor {name!r}" in str(info.value)
    assert needle in str(info.value), str(info.value)


def test_per_tensor_fp8_scales_are_whole_or_per_channel() -> None:
    w = {f"{M}.weight": T((64, 32))}
    scalar = geometry(f"{M}.input_scale", "F32", (), w, QuantScheme("fp8"))
    assert scalar.out.dim is None and scalar.inn.dim is None
    channel = geometry(f"{M}.weight_scale", "F32", (64, 1), w, QuantScheme("fp8"))
    assert channel.out.dim == 0 and channel.inn.dim is None
