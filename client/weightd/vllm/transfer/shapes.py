"""Does a served version have the shapes of the engine's model? Decided before any fetch.

An engine moves to a new version in place: vLLM's parameters keep their shapes, so a
version whose tensors differ (another width, another vocabulary, tensors added or
missing, another dtype) cannot be loaded, and must be refused before any rank loads a
byte. What the engine was built from is its model directory: ``config.json`` always,
usually the safetensors too. Their headers say every tensor's name, dtype and shape;
the daemon's description of the version says the same of it. Only headers are read
(each bounded, as safetensors bounds them), never tensor bytes.

A directory without safetensors (the weights only ever came from weightd) is compared
on ``config.json``'s architecture and the fields that fix the shapes.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Final

from weightd.client import ModelDescription

#: safetensors refuses headers over 100 MB; so does this reader.
MAX_HEADER_BYTES: Final = 100_000_000
#: Files listed at most (a checkpoint has tens to hundreds of shards).
MAX_SHARDS: Final = 100_000
#: config.json fields that fix parameter shapes (besides the architecture).
SHAPE_FIELDS: Final = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
)

Signature = dict[str, tuple[str, tuple[int, ...]]]


def header_signature(path: Path) -> Signature:
    """name -> (dtype, shape) of every tensor in one safetensors file (its header only)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES or length > os.fstat(f.fileno()).st_size:
            raise ValueError(f"{path}: header length {length} is not plausible")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    out: Signature = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: tensor {name[:200]!r} has no entry")
        out[name] = (str(entry.get("dtype")), tuple(int(n) for n in entry.get("shape", ())))
    return out


def directory_signature(directory: Path) -> Signature | None:
    """Every tensor of the checkpoint in ``directory``; None when it holds no safetensors."""
    files = sorted(directory.glob("*.safetensors"))[:MAX_SHARDS]
    if not files:
        return None
    out: Signature = {}
    for path in files:
        out.update(header_signature(path))
    return out


def served_signature(desc: ModelDescription) -> Signature:
    return {t.name: (t.dtype, tuple(t.shape)) for t in desc.tensors}


def _config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if path.stat().st_size > 64 << 20:
        raise ValueError(f"{path}: larger than 64 MiB")
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _first_architecture(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or [""]
    return str(archs[0]) if isinstance(archs, list) and archs else ""


def differences(directory: Path, desc: ModelDescription, limit: int = 5) -> list[str]:
    """How ``desc`` differs from the checkpoint the engine was built from (empty: none
    that changes a parameter); at most ``limit`` lines, then how many more."""
    out: list[str] = []
    mine = directory_signature(directory)
    if mine is not None:
        served = served_signature(desc)
        for name in sorted(mine.keys() | served.keys()):
            here, there = mine.get(name), served.get(name)
            if here == there:
                continue
            if here is None:
                out.append(f"{name}: not in the engine's checkpoint, {there} in the version")
            elif there is None:
                out.append(f"{name}: {here} in the engine's checkpoint, not in the version")
            else:
                out.append(f"{name}: {here} in the engine's checkpoint, {there} in the version")
    else:
        config = _config(directory)
        served_config = json.loads(desc.config_json or "{}")
        if not isinstance(served_config, dict):
            served_config = {}
        arch, served_arch = _first_architecture(config), desc.architecture
        if arch != served_arch:
            out.append(f"architecture: {arch!r} in the engine, {served_arch!r} in the version")
        for key in SHAPE_FIELDS:
            if config.get(key) != served_config.get(key):
                out.append(
                    f"config {key}: {config.get(key)!r} in the engine, "
                    f"{served_config.get(key)!r} in the version"
                )
    if len(out) > limit:
        out = [*out[:limit], f"... and {len(out) - limit} more"]
    return out
