"""Where LoRA applies and with which scaling: weightd's answer against real PEFT's (#15 item 3).

Two checks, both against the installed ``peft``:

* a table of configs x module names through PEFT's own matcher
  (``check_target_module_exists``, ``get_pattern_key``), each config saved by
  ``LoraConfig.save_pretrained`` and parsed by weightd from that file;
* real PEFT models built with ``exclude_modules``, ``layers_to_transform``,
  ``layers_pattern``, ``rank_pattern``/``alpha_pattern``, ``use_rslora`` and regex
  targets, saved, loaded by weightd: the modules that get a pair, their ``r`` and
  scaling are exactly PEFT's LoRA layers.

Before, ``exclude_modules`` and ``layers_to_transform`` were accepted and ignored:
pairs PEFT never applies were served (a file with them verified cleanly).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.adapters.conftest import Fixture
from weightd.server.adapters.config import AdapterConfig, parse_adapter_config
from weightd.server.adapters.load import load_adapter
from weightd.server.base.errors import (
    AdapterConfigError,
    AdapterTargetError,
    UnsupportedAdapterFeature,
)
from weightd.server.checkpoint.scan import load_checkpoint

MODULES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.1.self_attn.q_proj",
    "model.layers.1.mlp.down_proj",
    "model.layers.11.mlp.up_proj",
    "model.layers.2.block_sparse_moe.experts.3.w1",
    "model.h.5.attn.q_proj",
    "transformer.h.1.attn.c_attn",
    "q_proj",
    "lm_head",
    "model.layers.0.self_attn.xq_proj",
    "model.decoder.layers.3.fc1",
]
CONFIGS: list[dict[str, Any]] = [
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": ["q_proj", "model.layers.1.mlp.down_proj"]},
    {"target_modules": r".*\.(q|v)_proj"},
    {"target_modules": r"model\.layers\.\d+\.(self_attn|mlp)\..*"},
    {"target_modules": ["q_proj", "k_proj"], "exclude_modules": ["k_proj"]},
    {"target_modules": ["q_proj"], "exclude_modules": r".*layers\.1\..*"},
    {
        "target_modules": ["q_proj", "down_proj", "up_proj"],
        "exclude_modules": ["layers.1.mlp.down_proj"],
    },
    {"target_modules": r".*_proj", "exclude_modules": r".*\.0\..*"},
    {"target_modules": ["q_proj", "down_proj"], "layers_to_transform": [1]},
    {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": 11},
    {"target_modules": ["q_proj"], "layers_to_transform": [0, 5], "layers_pattern": "h"},
    {
        "target_modules": ["q_proj", "c_attn"],
        "layers_to_transform": [1, 5],
        "layers_pattern": ["h"],
    },
    {"target_modules": ["w1", "q_proj"], "layers_to_transform": [2], "layers_pattern": "layers"},
    {"target_modules": ["fc1"], "layers_to_transform": [3], "layers_pattern": ["decoder.layers"]},
    {"target_modules": ["q_proj", "model.layers.0.self_attn.k_proj"], "layers_to_transform": [1]},
    {"target_modules": ["q_proj"], "layers_to_transform": []},
    {"target_modules": ["q_proj", "k_proj"], "exclude_modules": [], "layers_to_transform": [0]},
]


def _saved(config: Any, tmp_path: Path) -> AdapterConfig:
    """Save with PEFT, parse the very file with weightd."""
    out = tmp_path / "cfg"
    config.save_pretrained(str(out))
    path = out / "adapter_config.json"
    return parse_adapter_config(str(path), path.read_bytes())


@pytest.mark.parametrize("fields", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_targets_match_peft_check_target_module_exists(
    fields: dict[str, Any], tmp_path: Path
) -> None:
    import peft
    from peft.tuners.tuners_utils import _ExcludedModule, check_target_module_exists

    config = peft.LoraConfig(r=4, lora_alpha=8, **fields)
    ours = _saved(config, tmp_path)
    for key in MODULES:
        found = check_target_module_exists(config, key)
        peft_targets = bool(found) and not isinstance(found, _ExcludedModule)
        assert ours.targets(key) is peft_targets, (fields, key)
        if not peft_targets:
            why = ours.why_not(key)
            assert why is not None
            assert any(f in why for f in ("exclude_modules", "target_modules", "layers_to_"))


PATTERNS: list[dict[str, Any]] = [
    {"rank_pattern": {"q_proj": 2, "layers.1.mlp.down_proj": 6}, "alpha_pattern": {"v_proj": 3}},
    {"rank_pattern": {r"layers\.1\..*": 2, "q_proj": 16}, "alpha_pattern": {r".*mlp.*": 1}},
    {"rank_pattern": {"proj": 5, "up_proj": 7}},  # "proj" matches no name: not a dot-suffix
    {"rank_pattern": {"model.layers.0.self_attn.q_proj": 3}, "use_rslora": True},
    {"alpha_pattern": {"(q|k)_proj": 32}, "use_rslora": True},
]


@pytest.mark.parametrize("fields", PATTERNS, ids=[str(i) for i in range(len(PATTERNS))])
def test_rank_and_alpha_match_peft_get_pattern_key(fields: dict[str, Any], tmp_path: Path) -> None:
    import math

    import peft
    from peft.utils.other import get_pattern_key

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **fields)
    ours = _saved(config, tmp_path)
    for key in MODULES:
        r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), key), config.r)
        alpha = config.alpha_pattern.get(
            get_pattern_key(config.alpha_pattern.keys(), key), config.lora_alpha
        )
        assert ours.rank_for(key) == r, (fields, key)
        assert ours.alpha_for(key) == alpha, (fields, key)
        want = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        assert ours.scaling_for(key) == want


MODELS: list[dict[str, Any]] = [
    {
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "exclude_modules": ["layers.0.self_attn.v_proj"],
    },
    {"target_modules": ["q_proj", "k_proj", "up_proj"], "exclude_modules": r".*\.1\.self_attn\..*"},
    {"target_modules": ["q_proj", "o_proj", "gate_proj"], "layers_to_transform": [1]},
    {
        "target_modules": ["q_proj", "down_proj"],
        "layers_to_transform": 0,
        "layers_pattern": "layers",
    },
    {
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "rank_pattern": {"down_proj": 2, r"layers\.1\.self_attn\.q_proj": 6},
        "alpha_pattern": {"v_proj": 3},
    },
    {"target_modules": r".*\.(q|k)_proj", "use_rslora": True, "rank_pattern": {"k_proj": 8}},
]


@pytest.mark.parametrize("fields", MODELS, ids=[str(i) for i in range(len(MODELS))])
def test_real_peft_models_get_pairs_exactly_where_weightd_serves_them(
    fields: dict[str, Any], lora: Fixture, tmp_path: Path
) -> None:
    import peft
    import transformers
    from peft.tuners.lora import LoraLayer

    base = transformers.LlamaForCausalLM.from_pretrained(str(lora.base_dir), dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **fields)
    model = peft.get_peft_model(base, config)
    root = tmp_path / "adapters"
    model.save_pretrained(str(root / "a"))
    want = {
        name.removeprefix("base_model.model."): (m.r["default"], m.scaling["default"])
        for name, m in model.named_modules()
        if isinstance(m, LoraLayer)
    }
    assert want  # the config applies somewhere
    ckpt, store = load_checkpoint(str(lora.base_dir), "tiny-llama")
    store.close()
    adapter = load_adapter(str(root / "a"), [str(root)], ckpt)
    assert {m.module: (m.r, m.scaling) for m in adapter.modules} == want


def test_pairs_peft_would_not_apply_are_refused_naming_the_field(
    lora: Fixture, tmp_path: Path
) -> None:
    """A file holding a pair for a module its own config excludes (or whose layer it does
    not transform) is refused: PEFT would drop it, a worker would apply it."""
    root = tmp_path / "adapters"
    ckpt, store = load_checkpoint(str(lora.base_dir), "tiny-llama")
    store.close()
    good = load_file(str(lora.adapter_dir / "adapter_model.safetensors"))
    cfg = json.loads((lora.adapter_dir / "adapter_config.json").read_text())
    for name, change, needle in [
        (
            "excluded",
            {"exclude_modules": ["layers.0.self_attn.q_proj"]},
            "is excluded by exclude_modules",
        ),
        ("excluded-re", {"exclude_modules": r".*\.k_proj"}, "is excluded by exclude_modules"),
        ("layer", {"layers_to_transform": [1]}, "is in layer 0, which layers_to_transform [1]"),
    ]:
        d = root / name
        d.mkdir(parents=True)
        save_file(good, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(AdapterTargetError, match="has LoRA weights but") as info:
            load_adapter(str(d), [str(root)], ckpt)
        assert needle in str(info.value)


REFUSED: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"use_dora": True}, UnsupportedAdapterFeature, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, UnsupportedAdapterFeature, "modules_to_save"),
    (
        {"target_parameters": ["mlp.experts.down_proj"]},
        UnsupportedAdapterFeature,
        "target_parameters",
    ),
    ({"trainable_token_indices": [1, 2]}, UnsupportedAdapterFeature, "trainable_token_indices"),
    ({"layer_replication": [[0, 2]]}, UnsupportedAdapterFeature, "layer_replication"),
    ({"init_lora_weights": "pissa"}, UnsupportedAdapterFeature, "'init_lora_weights' is 'pissa'"),
    ({"init_lora_weights": "olora"}, UnsupportedAdapterFeature, "rewrites the base weights"),
    ({"ensure_weight_tying": True}, UnsupportedAdapterFeature, "ensure_weight_tying"),
    ({"megatron_config": {"tp": 2}}, UnsupportedAdapterFeature, "Megatron"),
    ({"use_bdlora": {"nblocks": 2}}, UnsupportedAdapterFeature, "block-diagonal"),
    ({"some_future_field": 3}, UnsupportedAdapterFeature, "does not know this LoraConfig field"),
    (
        {"target_modules": r".*q_proj", "layers_to_transform": [0]},
        AdapterConfigError,
        "'layers_to_transform' cannot be used when 'target_modules' is a regex",
    ),
    ({"layers_pattern": "layers"}, AdapterConfigError, "'layers_to_transform' is not"),
    ({"layers_to_transform": [True]}, AdapterConfigError, "must be an integer or a list"),
    ({"exclude_modules": r"(a)\1"}, AdapterConfigError, "field 'exclude_modules': "),
    (
        {"layers_to_transform": [0], "layers_pattern": "(?=x)"},
        AdapterConfigError,
        "field 'layers_pattern': ",
    ),
    ({"target_modules": ["q"] * 70_000}, AdapterConfigError, "lists 70000 names; the limit"),
]


@pytest.mark.parametrize(("change", "error", "needle"), REFUSED, ids=[r[2][:30] for r in REFUSED])
def test_fields_peft_applies_otherwise_are_refused_by_name(
    change: dict[str, Any], error: type[Exception], needle: str, lora: Fixture
) -> None:
    cfg = json.loads((lora.adapter_dir / "adapter_config.json").read_text())
    raw = json.dumps({**cfg, **change}).encode()
    with pytest.raises(error) as info:
        parse_adapter_config("d/adapter_config.json", raw)
    assert str(info.value).startswith("d/adapter_config.json: ")
    assert needle in str(info.value)


def test_every_field_peft_saves_is_classified(tmp_path: Path) -> None:
    """A default LoraConfig, as the installed PEFT saves it, parses: no field it writes is
    unknown (a new PEFT field with a non-default value would be refused, not ignored)."""
    import peft

    ours = _saved(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), tmp_path)
    assert ours.targets("model.layers.0.self_attn.q_proj")
