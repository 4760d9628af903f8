"""A Llama-style sharded bf16 checkpoint of a chosen size (TinyLlama widths), for benchmarks.

Generated, never downloaded. The number of layers is chosen to reach the requested
size; everything else follows TinyLlama-1.1B (hidden 2048, 32 heads, 4 kv heads,
intermediate 5632, vocab 32000), so the TP cases exercise GQA and row/column splits of
realistic shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class Widths:
    hidden: int = 2048
    inter: int = 5632
    heads: int = 32
    kv: int = 4
    vocab: int = 32000


TINYLLAMA = Widths()
SMOKE = Widths(hidden=256, inter=704, heads=8, kv=4, vocab=4096)


def _layer_bytes(w: Widths) -> int:
    head_dim = w.hidden // w.heads
    q = w.hidden * w.hidden
    kv = 2 * w.kv * head_dim * w.hidden
    o = w.hidden * w.hidden
    mlp = 3 * w.inter * w.hidden
    return 2 * (q + kv + o + mlp + 2 * w.hidden)


def config(layers: int, w: Widths) -> dict[str, object]:
    HIDDEN, INTER, HEADS, KV, VOCAB = w.hidden, w.inter, w.heads, w.kv, w.vocab  # noqa: N806
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "head_dim": HIDDEN // HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def make_checkpoint(
    directory: Path, size_bytes: int, shards: int = 4, seed: int = 0, widths: Widths = TINYLLAMA
) -> Path:
    """Write the checkpoint unless ``directory`` already holds one of the same size."""
    HIDDEN, INTER, HEADS, KV, VOCAB = (  # noqa: N806
        widths.hidden,
        widths.inter,
        widths.heads,
        widths.kv,
        widths.vocab,
    )
    HEAD_DIM = HIDDEN // HEADS  # noqa: N806
    marker = directory / ".weightd-bench.json"
    want = {"size_bytes": size_bytes, "shards": shards, "seed": seed, **asdict(widths)}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.safetensors"):
        old.unlink()
    embed = 2 * VOCAB * HIDDEN * 2
    layers = max(1, round((size_bytes - embed) / _layer_bytes(widths)))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32).mul_(0.02).to(torch.bfloat16)

    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV * HEAD_DIM, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV * HEAD_DIM, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
        ]
    names += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    total = sum(2 * int(torch.Size(s).numel()) for _, s in names)
    per_shard = total / shards
    weight_map: dict[str, str] = {}
    part: dict[str, torch.Tensor] = {}
    part_bytes, index = 0, 1

    def flush() -> None:
        nonlocal part, part_bytes, index
        file = f"model-{index:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        part, part_bytes, index = {}, 0, index + 1

    for name, shape in names:
        part[name] = rand(*shape)
        part_bytes += 2 * part[name].numel()
        if part_bytes >= per_shard and index < shards:
            flush()
    if part:
        flush()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (directory / "config.json").write_text(json.dumps(config(layers, widths)))
    marker.write_text(json.dumps(want))
    os.sync()
    return directory


def add_rank_bench_args(p: argparse.ArgumentParser) -> None:
    """Options of the single-rank benchmarks (grpc_throughput, load_into): one checkpoint."""
    p.add_argument("--size-mb", type=int, default=400, help="checkpoint size (generated)")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: /tmp)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny widths (tests: it still runs)")


def warm_rank_checkpoint(args: argparse.Namespace) -> Path:
    """The checkpoint those options name, written if missing, and read into the page cache."""
    directory = args.dir or Path(tempfile.gettempdir()) / f"weightd-grpc-bench-{args.size_mb}M"
    widths = SMOKE if args.smoke else TINYLLAMA
    make_checkpoint(directory, args.size_mb * 1_000_000, shards=2, widths=widths)
    for f in directory.iterdir():
        if f.is_file():
            f.read_bytes()
    return directory
