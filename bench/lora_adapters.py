"""A tiny real Llama and real PEFT LoRA adapters for it (no download), for vLLM's LoRA.

Made with ``transformers`` and ``peft`` in the project's venv; vLLM (its own venv) then
serves the base from its directory and the adapters through weightd or from theirs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from weightd.common.digests import adapter_digest

#: Attention and MLP projections: every linear layer of a Llama block.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
#: The tests' base: GQA 8/2, a vocabulary that is no multiple of 64, untied head.
SMALL_BASE: dict[str, Any] = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def make_base(directory: Path, overrides: dict[str, Any] | None = None, seed: int = 0) -> Path:
    """A random float32 Llama saved like a hub checkpoint (config.json + safetensors)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**(overrides or SMALL_BASE))
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    model.save_pretrained(str(directory))
    return directory


def make_adapter(
    base_dir: Path,
    out: Path,
    seed: int,
    r: int = 8,
    rank_pattern: dict[str, int] | None = None,
    scale: float = 1.0,
) -> Path:
    """A PEFT LoRA adapter on every projection, with non-zero ``lora_B`` (it changes the
    output); ``scale`` multiplies its weights so different adapters give different tokens."""
    import peft
    import torch
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=TARGETS,
        rank_pattern=rank_pattern or {},
        init_lora_weights=False,
    )
    model = peft.get_peft_model(base, config).eval()
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.mul_(scale)
    model.save_pretrained(str(out))
    return out


def digest_of(directory: Path) -> str:
    """The adapter digest weightd computes (and an operator pins) for ``directory``."""

    def sha(name: str) -> str:
        return hashlib.sha256((directory / name).read_bytes()).hexdigest()

    return adapter_digest(sha("adapter_config.json"), sha("adapter_model.safetensors"))


def retarget(source: Path, out: Path, base_model: str) -> Path:
    """A copy of ``source`` whose config names another base model."""
    out.mkdir(parents=True)
    config = json.loads((source / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base_model
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes()
    )
    return out
