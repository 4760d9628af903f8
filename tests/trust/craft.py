"""Hand-built safetensors checkpoints, byte by byte, so tests can break them precisely.

The base checkpoint is a real (tiny) Llama: its config and tensor set are what
``transformers`` would build, in two shards with an index. Header text is written
by these helpers, not by the safetensors library, so a test can put a duplicate key,
a NaN or a misaligned offset exactly where it wants.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8,
    "hidden_size": 4,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"

#: name -> (shard, shape); every tensor F32.
PARAMS: dict[str, tuple[str, tuple[int, ...]]] = {
    "model.embed_tokens.weight": (SHARD1, (8, 4)),
    "model.layers.0.input_layernorm.weight": (SHARD1, (4,)),
    "model.layers.0.self_attn.q_proj.weight": (SHARD1, (4, 4)),
    "model.layers.0.self_attn.k_proj.weight": (SHARD1, (2, 4)),
    "model.layers.0.self_attn.v_proj.weight": (SHARD1, (2, 4)),
    "model.layers.0.self_attn.o_proj.weight": (SHARD1, (4, 4)),
    "model.layers.0.post_attention_layernorm.weight": (SHARD2, (4,)),
    "model.layers.0.mlp.gate_proj.weight": (SHARD2, (8, 4)),
    "model.layers.0.mlp.up_proj.weight": (SHARD2, (8, 4)),
    "model.layers.0.mlp.down_proj.weight": (SHARD2, (4, 8)),
    "model.norm.weight": (SHARD2, (4,)),
    "lm_head.weight": (SHARD2, (8, 4)),
}


def payload(name: str, nbytes: int) -> bytes:
    """Deterministic, name-dependent bytes (finite float32 values)."""
    seed = sum(name.encode()) % 97
    return bytes((seed + i * 7) % 61 for i in range(nbytes))


def entries(tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[dict[str, Any], bytes]:
    """A header dict (with data_offsets) and the data section for ``tensors``."""
    widths = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I64": 8}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for name, dtype, shape in tensors:
        n = widths[dtype]
        for d in shape:
            n *= d
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [len(data), len(data) + n],
        }
        data += payload(name, n)
    return header, bytes(data)


def encode(
    header: dict[str, Any] | str | bytes, data: bytes, *, length: int | None = None
) -> bytes:
    """A safetensors file: 8-byte length, header (space-padded to 8), data."""
    if isinstance(header, dict):
        header = json.dumps(header)
    raw = header.encode() if isinstance(header, str) else header
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def shard_tensors(shard: str) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(n, "F32", shape) for n, (s, shape) in PARAMS.items() if s == shard]


def write_checkpoint(directory: Path, config: dict[str, Any] | None = None) -> Path:
    """The valid base checkpoint: config.json, index, two shards."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or CONFIG))
    total = 0
    for shard in (SHARD1, SHARD2):
        header, data = entries(shard_tensors(shard))
        (directory / shard).write_bytes(encode(header, data))
        total += len(data)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {n: s for n, (s, _) in PARAMS.items()},
    }
    (directory / INDEX).write_text(json.dumps(index))
    return directory


def read_index(directory: Path) -> dict[str, Any]:
    return json.loads((directory / INDEX).read_text())


def write_index(directory: Path, index: dict[str, Any] | str) -> None:
    text = index if isinstance(index, str) else json.dumps(index)
    (directory / INDEX).write_text(text)


def fix_total(directory: Path) -> None:
    """Set metadata.total_size to the data bytes of the shards the index names."""
    index = read_index(directory)
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        raw = (directory / shard).read_bytes()
        total += len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]
    index["metadata"]["total_size"] = total
    write_index(directory, index)


def put_shard(directory: Path, shard: str, tensors: list[tuple[str, str, tuple[int, ...]]]) -> None:
    """Write ``shard`` holding ``tensors``; the index maps exactly them to it."""
    header, data = entries(tensors)
    (directory / shard).write_bytes(encode(header, data))
    index = read_index(directory)
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if s != shard}
    index["weight_map"].update({n: shard for n, _, _ in tensors})
    write_index(directory, index)
    fix_total(directory)
