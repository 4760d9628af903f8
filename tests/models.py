"""Tiny real checkpoints for tests, and an independent statement of the TP rules.

``expected_slice`` restates the slicing rules from the issue text with plain torch
indexing, deliberately without calling weightd's planner, so the end-to-end tests
compare the daemon against the rules rather than against itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

# Every config divides by world sizes 1, 2 and 4 where the rules need it.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # MHA Llama, untied embeddings
    "llama": (
        "llama",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
    # GQA with fewer kv heads than ranks at world size 4, tied embeddings
    "llama-gqa": (
        "llama",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen2: q/k/v biases
    "qwen2": (
        "qwen2",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3: q_norm / k_norm, explicit head_dim
    "qwen3": (
        "qwen3",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
        ),
    ),
    # Mistral
    "mistral": (
        "mistral",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
}


#: A small GQA Llama (8 query / 2 kv heads, untied head) for tests that need several
#: versions of one model: the same config with another ``seed`` is another version.
VERSIONED_LLAMA: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def build_model(kind: str, overrides: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**overrides))
    # Random norms too, so a norm served from the wrong place would show.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return model.eval()


def write_transformers_models(root: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for name, (kind, overrides) in CONFIGS.items():
        directory = root / name
        build_model(kind, overrides).save_pretrained(directory, max_shard_size="40KB")
        assert (directory / "model.safetensors.index.json").exists()
        out[name] = directory
    out["unknown-arch"] = write_unknown_arch(root / "unknown-arch")
    return out


def write_unknown_arch(directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(
        json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"})
    )
    torch.manual_seed(1)
    save_file(
        {"foo.weight": torch.randn(8, 4), "foo.bias": torch.randn(8)},
        str(directory / "model.safetensors"),
    )
    return directory


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with safetensors itself."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def expected_slice(
    name: str, t: torch.Tensor, config: dict[str, Any], ws: int, rank: int
) -> torch.Tensor:
    """The TP rules of the core issue, restated with torch indexing."""
    if ws == 1:
        return t
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if re.search(r"\.(k_proj|v_proj)\.(weight|bias)$", name):
        if ws <= kv:
            return t.chunk(ws, 0)[rank]
        head = rank // (ws // kv)
        return t[head * head_dim : (head + 1) * head_dim]
    if re.search(r"\.(q_proj|gate_proj|up_proj)\.(weight|bias)$", name):
        return t.chunk(ws, 0)[rank]
    if re.search(r"\.(o_proj|down_proj)\.weight$", name):
        return t.chunk(ws, 1)[rank]
    if re.search(r"(embed_tokens|lm_head)\.weight$", name):
        return t.chunk(ws, 0)[rank]
    return t  # norms, q_norm/k_norm, o/down biases: replicated


def split_dim(name: str) -> int | None:
    if re.search(r"\.(o_proj|down_proj)\.weight$", name):
        return 1
    if re.search(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", name) or re.search(
        r"(embed_tokens|lm_head)\.weight$", name
    ):
        return 0
    return None


def spy_load_state_dict(module: torch.nn.Module) -> list[set[str]]:
    """Record the names each ``load_state_dict`` call on ``module`` is given."""
    calls: list[set[str]] = []
    original = module.load_state_dict

    def spy(state: Any, strict: bool = True, assign: bool = False) -> Any:
        calls.append(set(state))
        return original(state, strict=strict, assign=assign)

    module.load_state_dict = spy  # type: ignore[method-assign]
    return calls
