"""A tiny real Llama (GQA) base and real PEFT LoRA adapters for it, made once per session."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models import build_model

BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Fixture:
    root: Path  # the adapter root
    base_dir: Path
    adapter_dir: Path  # a good adapter under root
    second_dir: Path  # another good adapter (other seed, other r) under root
    peft_model: Any  # the PeftModel the first adapter was saved from


def make_adapter(
    base_dir: Path, out: Path, seed: int, r: int, rank_pattern: dict[str, int] | None = None
) -> Any:
    import peft
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=TARGETS,
        rank_pattern=rank_pattern or {},
        init_lora_weights=False,  # non-zero lora_B: the adapter changes the output
    )
    model = peft.get_peft_model(base, config).eval()
    model.save_pretrained(str(out))
    return model


@pytest.fixture(scope="session")
def lora(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    top = tmp_path_factory.mktemp("lora")
    base_dir = top / "tiny-llama"
    build_model("llama", BASE_CONFIG).save_pretrained(str(base_dir))
    root = top / "adapters"
    root.mkdir()
    model = make_adapter(base_dir, root / "good", 1, 4, {"down_proj": 2})
    make_adapter(base_dir, root / "second", 2, 8)
    cfg = json.loads((root / "good" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base_dir)
    return Fixture(root, base_dir, root / "good", root / "second", model)
