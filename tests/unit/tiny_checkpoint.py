"""Tiny real checkpoints on disk: a one-layer Llama written with safetensors, and its facts.

Shared by the tests that load them: ``checkpoint/test_scan*.py`` (parsing and refusing
a directory), ``store/test_shard_changes.py`` (files changing under the store) and
``trust/test_integrity.py`` (digests and anchors).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors.torch import save_file

from weightd.server.checkpoint.description import INDEX_FILE, Checkpoint
from weightd.server.checkpoint.scan import load_checkpoint
from weightd.server.store.shards import ShardStore

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "num_hidden_layers": 1,
    "vocab_size": 64,
}
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def llama_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": rand(64, 16),
        p + "input_layernorm.weight": rand(16),
        p + "self_attn.q_proj.weight": rand(16, 16),
        p + "self_attn.k_proj.weight": rand(8, 16),
        p + "self_attn.v_proj.weight": rand(8, 16),
        p + "self_attn.o_proj.weight": rand(16, 16),
        p + "post_attention_layernorm.weight": torch.randn(16, generator=gen),
        p + "mlp.gate_proj.weight": rand(32, 16),
        p + "mlp.up_proj.weight": rand(32, 16),
        p + "mlp.down_proj.weight": rand(16, 32),
        "model.norm.weight": torch.randn(16, generator=gen),
        "lm_head.weight": rand(64, 16),
    }


def split_in_two(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    names = list(tensors)
    half = len(names) // 2
    return {
        SHARD1: {n: tensors[n] for n in names[:half]},
        SHARD2: {n: tensors[n] for n in names[half:]},
    }


def tbytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))


def index_doc(shards: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    weight_map = {n: shard for shard, ts in shards.items() for n in ts}
    total = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


def write_model(
    root: Path,
    shards: dict[str, dict[str, torch.Tensor]],
    *,
    config: dict[str, Any] | None = None,
    index: bool = True,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_json(root / "config.json", CONFIG if config is None else config)
    for name, ts in shards.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        save_file(ts, str(root / name), metadata={"format": "pt", "shard": name})
    if index:
        write_json(root / INDEX_FILE, index_doc(shards))
    return root


@contextlib.contextmanager
def loaded(root: Path) -> Iterator[tuple[Checkpoint, ShardStore]]:
    ckpt, store = load_checkpoint(str(root))
    try:
        yield ckpt, store
    finally:
        store.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


T1 = "model.embed_tokens.weight"  # first tensor: stored in SHARD1
T2 = "lm_head.weight"  # last tensor: stored in SHARD2


def _b3(data: bytes) -> str:
    return "blake3:" + blake3.blake3(data).hexdigest()
