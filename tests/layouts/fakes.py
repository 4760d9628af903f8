"""In-memory checkpoints for planner tests: real bytes, made-up offsets, no files.

Each tensor is a torch tensor; the checkpoint description points into one byte
buffer per shard, so a plan's run pattern can be gathered and compared with the
slice torch cuts from the same tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightd.common.dtypes import DTYPE_BITS
from weightd.server.checkpoint.description import Checkpoint, TensorInfo
from weightd.server.store.runs import RunPattern

DATA_START = 128
DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I32": torch.int32,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
}

Spec = tuple[str, tuple[int, ...]]


def random_tensor(dtype: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bytes as a tensor of ``dtype``; sub-byte dtypes (F4) as their raw bytes."""
    nbytes = math.prod(shape) * DTYPE_BITS[dtype] // 8
    raw = torch.randint(0, 256, (nbytes,), generator=gen).to(torch.uint8)
    if dtype not in DTYPES:
        return raw
    return raw.view(DTYPES[dtype]).reshape(shape)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@dataclass
class Fake:
    ckpt: Checkpoint
    buffers: dict[str, bytes]
    tensors: dict[str, torch.Tensor]

    def gather(self, shard: str, pattern: RunPattern) -> bytes:
        buf = self.buffers[shard]
        return b"".join(buf[o : o + n] for o, n in pattern.ranges())


def fake_checkpoint(
    config: Mapping[str, Any],
    specs: Mapping[str, Spec],
    *,
    shards: int = 2,
    seed: int = 0,
    values: Mapping[str, torch.Tensor] | None = None,
) -> Fake:
    """Tensors back to back (8-byte aligned) after DATA_START, round-robin over shards."""
    gen = torch.Generator().manual_seed(seed)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts: dict[str, list[bytes]] = {s: [bytes(DATA_START)] for s in names}
    cursor = dict.fromkeys(names, DATA_START)
    infos: list[TensorInfo] = []
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, (dtype, shape)) in enumerate(specs.items()):
        t = (values or {}).get(name)
        if t is None:
            t = random_tensor(dtype, tuple(shape), gen)
        tensors[name] = t
        shard = names[i % shards]
        raw = as_bytes(t)
        infos.append(TensorInfo(name, dtype, tuple(shape), shard, cursor[shard], len(raw)))
        pad = -len(raw) % 8
        parts[shard].append(raw + bytes(pad))
        cursor[shard] += len(raw) + pad
    infos.sort(key=lambda t: (names.index(t.shard), t.offset))
    ckpt = Checkpoint(
        name="tiny",
        root="/nonexistent/tiny",
        config=dict(config),
        config_json="{}",
        tensors={t.name: t for t in infos},
        shards=tuple(names),
    )
    return Fake(ckpt, {s: b"".join(p) for s, p in parts.items()}, tensors)
