"""Tiny random ``transformers`` models of every built-in architecture, and quantized ones.

Written with ``save_pretrained(max_shard_size=...)`` so each is a real sharded HF
checkpoint with an index. Sizes divide by tensor-parallel 1, 2 and 4 everywhere the
rules need it; MoE models have 4 experts (expert parallel 1, 2, 4).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.layouts import quantfmt

COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
MOE: dict[str, Any] = {"num_experts_per_tok": 2, "intermediate_size": 64}

#: name → (transformers class names, config overrides)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        {"num_key_value_heads": 1, "head_dim": 8, "tie_word_embeddings": True},
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {"num_key_value_heads": 4, "head_dim": 8, "tie_word_embeddings": True},
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**MOE, "num_local_experts": 4}),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **MOE,
            "num_experts": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [0],
        },
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**MOE, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 8},
    ),
}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    config_cls, model_cls, over = ARCHS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **over})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # random norms, so a norm served from the wrong place shows
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.1)
    return model.eval()


def write_models(root: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for name in ARCHS:
        directory = root / name
        build(name).save_pretrained(directory, max_shard_size="60KB")
        assert (directory / "model.safetensors.index.json").exists(), name
        out[name] = directory
    return out


QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "gptq-act": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
#: Llama names; (out, in) of each quantized linear module.
QUANT_MODULES = {
    "model.layers.0.self_attn.q_proj": (512, 256),
    "model.layers.0.self_attn.o_proj": (256, 512),
    "model.layers.0.mlp.gate_proj": (512, 256),
    "model.layers.0.mlp.down_proj": (256, 512),
}


def write_quantized(
    root: Path, kind: str, seed: int = 0
) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    """A one-layer Llama-named checkpoint whose linear modules are quantized (``kind``)."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(seed)
    qc = QUANT_CONFIGS[kind]
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, (out, inn) in QUANT_MODULES.items():
        if kind.startswith("gptq"):
            modules[prefix] = quantfmt.gptq_module(out, inn, 128, rng, desc_act=qc["desc_act"])
        elif kind == "awq":
            modules[prefix] = quantfmt.awq_module(out, inn, 128, rng)
        else:
            modules[prefix] = quantfmt.fp8_module(out, inn, rng)
    tensors = {f"{p}.{role}": t.contiguous() for p, m in modules.items() for role, t in m.items()}
    tensors["model.norm.weight"] = torch.ones(256, dtype=torch.float16)
    directory = root / f"quant-{kind}"
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_hidden_layers": 1,
        "quantization_config": qc,
    }
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory, modules
