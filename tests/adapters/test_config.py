"""adapter_config.json parsing: a table of documents and what each must give. Pure."""

from __future__ import annotations

import json
from typing import Any

import pytest

from weightd.server.adapters.config import parse_adapter_config
from weightd.server.base.errors import AdapterConfigError, UnsupportedAdapterFeature

GOOD: dict[str, Any] = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["v_proj", "q_proj"],
    "base_model_name_or_path": "org/tiny",
    "bias": "none",
    "use_dora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}


def parse(**changes: Any) -> Any:
    doc = {**GOOD, **changes}
    doc = {k: v for k, v in doc.items() if v is not ...}
    return parse_adapter_config("a/adapter_config.json", json.dumps(doc).encode())


def test_good_config() -> None:
    c = parse()
    assert (c.r, c.lora_alpha, c.target_modules, c.base_model_name_or_path) == (
        8,
        16.0,
        ("q_proj", "v_proj"),
        "org/tiny",
    )
    assert c.targets("model.layers.0.self_attn.q_proj")
    assert not c.targets("model.layers.0.self_attn.k_proj")
    assert not c.targets("model.layers.0.self_attn.xq_proj")
    assert c.scaling_for("model.layers.0.self_attn.q_proj") == 2.0


def test_patterns_and_rslora() -> None:
    c = parse(rank_pattern={"layers.1.self_attn.q_proj": 4}, alpha_pattern={"v_proj": 2})
    assert c.rank_for("model.layers.1.self_attn.q_proj") == 4
    assert c.rank_for("model.layers.11.self_attn.q_proj") == 8
    assert c.alpha_for("model.layers.0.self_attn.v_proj") == 2.0
    assert parse(use_rslora=True, r=4, lora_alpha=4).scaling_for("x.q_proj") == 2.0


def test_regex_targets() -> None:
    c = parse(target_modules=r".*\.layers\.0\..*proj")
    assert c.targets("model.layers.0.mlp.up_proj")
    assert not c.targets("model.layers.1.mlp.up_proj")


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"r": 0}, AdapterConfigError, "field 'r' must be in 1..65536, got 0"),
        ({"r": -3}, AdapterConfigError, "field 'r' must be in 1..65536, got -3"),
        ({"r": 4.0}, AdapterConfigError, "field 'r' must be an integer, got 4.0"),
        ({"r": True}, AdapterConfigError, "field 'r' must be an integer, got True"),
        ({"r": ...}, AdapterConfigError, "missing field 'r'"),
        ({"lora_alpha": ...}, AdapterConfigError, "missing field 'lora_alpha'"),
        ({"lora_alpha": "16"}, AdapterConfigError, "field 'lora_alpha' must be a number"),
        ({"target_modules": ...}, AdapterConfigError, "missing field 'target_modules'"),
        ({"target_modules": []}, AdapterConfigError, "must be a non-empty list or a regex"),
        ({"target_modules": [""]}, AdapterConfigError, "must list non-empty names"),
        ({"target_modules": "all-linear"}, AdapterConfigError, "'all-linear'"),
        ({"target_modules": "("}, AdapterConfigError, "is not a valid regex"),
        ({"rank_pattern": {"q_proj": 0}}, AdapterConfigError, "rank_pattern['q_proj']"),
        ({"rank_pattern": []}, AdapterConfigError, "field 'rank_pattern' must be an object"),
        ({"base_model_name_or_path": 3}, AdapterConfigError, "must be a string"),
        ({"use_rslora": "yes"}, AdapterConfigError, "field 'use_rslora' must be a boolean"),
        ({"use_dora": True}, UnsupportedAdapterFeature, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, UnsupportedAdapterFeature, "modules_to_save"),
        ({"bias": "all"}, UnsupportedAdapterFeature, "trained biases"),
        ({"bias": "lora_only"}, UnsupportedAdapterFeature, "field 'bias' is 'lora_only'"),
        ({"fan_in_fan_out": True}, UnsupportedAdapterFeature, "fan_in_fan_out"),
        ({"lora_bias": True}, UnsupportedAdapterFeature, "lora_bias"),
        ({"target_parameters": ["w"]}, UnsupportedAdapterFeature, "target_parameters"),
        ({"peft_type": "IA3"}, UnsupportedAdapterFeature, "peft_type 'IA3' is not served"),
    ],
)
def test_bad_configs(changes: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        parse(**changes)
    assert type(info.value) is error
    assert str(info.value).startswith("a/adapter_config.json: ")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"r": 1, "r": 2}', "duplicate key 'r'"),
        (b'{"r": NaN}', "non-finite number NaN"),
        (b"[]", "must be a JSON object"),
        (b"\xff", "not UTF-8"),
    ],
)
def test_not_strict_json(raw: bytes, message: str) -> None:
    with pytest.raises(AdapterConfigError, match=r"^a/adapter_config\.json: ") as info:
        parse_adapter_config("a/adapter_config.json", raw)
    assert message in str(info.value)
