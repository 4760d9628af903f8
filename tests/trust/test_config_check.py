"""The layouts config_check derives, against the parameters transformers itself builds."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from weightd.server.base.errors import (
    ConfigFieldError,
    MissingTensorError,
    TensorDtypeError,
    TensorShapeError,
    UnexpectedTensorError,
)
from weightd.server.checkpoint.config_check import check_layout, layout_function
from weightd.server.checkpoint.description import TensorInfo

SMALL = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# (transformers class names, extra config) — every flag that changes the parameter set.
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("LlamaConfig", "LlamaForCausalLM", {}),
    ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    ("LlamaConfig", "LlamaForCausalLM", {"head_dim": 8}),
    ("LlamaConfig", "LlamaModel", {}),
    ("MistralConfig", "MistralForCausalLM", {}),
    ("MistralConfig", "MistralForCausalLM", {"head_dim": 8}),
    ("Qwen2Config", "Qwen2ForCausalLM", {}),
    ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    ("Qwen3Config", "Qwen3ForCausalLM", {"attention_bias": True, "head_dim": 8}),
    ("Qwen3Config", "Qwen3Model", {"head_dim": 8}),
]


def _saved_tensors(model: torch.nn.Module) -> dict[str, TensorInfo]:
    """What save_pretrained writes: the state dict without tied duplicates."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    out = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        out[name] = TensorInfo(name, "F32", tuple(t.shape), "model.safetensors", 0, 0)
    return out


@pytest.mark.parametrize(("config_cls", "arch", "extra"), VARIANTS)
def test_layout_matches_transformers(config_cls: str, arch: str, extra: dict[str, Any]) -> None:
    import transformers

    config = getattr(transformers, config_cls)(**SMALL, **extra)
    model = getattr(transformers, arch)(config)
    doc = json.loads(config.to_json_string())
    doc["architectures"] = [arch]
    doc["dtype"] = "float32"
    tensors = _saved_tensors(model)
    report = check_layout("/m", doc, tensors)
    assert report.problems == [], [str(p) for p in report.problems]
    assert report.layout is not None
    assert {n for n, p in report.layout.params.items() if not p.optional} <= set(tensors)


def _tensors(shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> dict[str, TensorInfo]:
    return {n: TensorInfo(n, dtype, s, "s.safetensors", 0, 0) for n, s in shapes.items()}


def _llama_config(**over: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "torch_dtype": "bfloat16",
        **SMALL,
        "num_hidden_layers": 1,
        **over,
    }


def _llama_shapes() -> dict[str, tuple[int, ...]]:
    _, fn = layout_function(_llama_config())
    assert fn is not None
    layout = fn("/m/config.json", "LlamaForCausalLM", _llama_config())
    return {n: p.shape for n, p in layout.params.items()}


def test_clean_llama_has_no_problems() -> None:
    assert check_layout("/m", _llama_config(), _tensors(_llama_shapes())).problems == []


def test_every_kind_of_difference_is_reported() -> None:
    shapes = _llama_shapes()
    del shapes["model.layers.0.mlp.up_proj.weight"]
    shapes["model.layers.0.mlp.down_proj.weight"] = (24, 16)  # transposed
    shapes["model.layers.0.self_attn.k_proj.weight"] = (16, 16)  # wrong kv heads
    shapes["model.layers.0.extra.weight"] = (3,)
    tensors = _tensors(shapes)
    tensors["model.norm.weight"] = TensorInfo(
        "model.norm.weight", "F32", (16,), "s.safetensors", 0, 0
    )
    problems = check_layout("/m", _llama_config(), tensors).problems
    kinds = {type(p): str(p) for p in problems}
    assert set(kinds) == {
        MissingTensorError,
        TensorShapeError,
        UnexpectedTensorError,
        TensorDtypeError,
    }, [str(p) for p in problems]
    assert "up_proj" in kinds[MissingTensorError] and "/m/config.json" in kinds[MissingTensorError]
    transposed = [str(p) for p in problems if "transpose" in str(p)]
    assert len(transposed) == 1 and "down_proj" in transposed[0]
    assert "/m/s.safetensors" in kinds[UnexpectedTensorError]
    assert "torch_dtype='bfloat16'" in kinds[TensorDtypeError]


def test_transformers_5_dtype_key_and_auto() -> None:
    tensors = _tensors(_llama_shapes(), "F16")
    config = _llama_config(dtype="float16")
    del config["torch_dtype"]
    assert check_layout("/m", config, tensors).problems == []
    report = check_layout("/m", _llama_config(torch_dtype="auto"), tensors)
    assert report.problems == [] and any("dtype" in n for n in report.notes)


def test_unknown_architecture_is_a_note_not_a_problem() -> None:
    config = {"architectures": ["FooForCausalLM"], "torch_dtype": "float32"}
    report = check_layout("/m", config, _tensors({"w": (2, 2)}, "F32"))
    assert report.problems == [] and report.layout is None
    assert any("FooForCausalLM" in n and "not checked" in n for n in report.notes)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"torch_dtype": "bfloat17"}, "torch_dtype"),
        ({"num_hidden_layers": 10**6}, "num_hidden_layers"),
        ({"num_hidden_layers": 5000}, "num_hidden_layers"),
    ],
)
def test_bad_config_fields(over: dict[str, Any], field: str) -> None:
    problems = check_layout("/m", _llama_config(**over), _tensors(_llama_shapes())).problems
    assert problems and type(problems[0]) is ConfigFieldError
    assert f"'{field}'" in str(problems[0]) and "/m/config.json" in str(problems[0])
