"""Tensor-parallel sharding rules and per-rank slice plans. Pure: no I/O, no globals.

A plan is checked whole before a byte moves: :func:`plan_rank` either returns every
slice the rank needs, or raises naming the first tensor that cannot be split.

Rules are data: an architecture maps tensor-name patterns to a :class:`Split`. The
Llama family (Llama, Mistral, Qwen2, Qwen3) uses Megatron-style tensor parallelism:

* column-parallel (split dim 0 into equal contiguous blocks): q/k/v/gate/up
  projections and their biases;
* row-parallel (split dim 1): o_proj and down_proj; their biases are replicated;
* vocab-parallel (split dim 0): embed_tokens and lm_head;
* replicated: norms (including q_norm/k_norm) and rotary buffers.

Any other tensor name in a Llama-family checkpoint is an error at world size > 1
rather than a silent replication: an unknown 2-D weight served whole to every rank
would load without complaint and compute garbage.

GQA: k/v projections are split by whole kv heads. When the world size exceeds the
number of kv heads, each rank receives the one kv head its query heads attend with
(rank // (world_size // num_kv_heads)), which requires world_size to be a multiple of
num_kv_heads, as in vLLM and Megatron.

Tied embeddings: with ``tie_word_embeddings`` and no ``lm_head.weight`` tensor,
weightd serves no ``lm_head.weight`` (it never invents tensors). The rank's
``embed_tokens`` slice is exactly the vocab-parallel ``lm_head`` slice, so a TP engine
(or ``transformers``' weight tying after ``load_state_dict``) uses it for both.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from weightd.common.dtypes import DTYPE_BITS

from .checkpoint import Checkpoint, TensorInfo
from .errors import ConfigError, InvalidRequest, NoShardingRules, ShardingError, TensorNotFound
from .runs import RunPattern, block_pattern, whole_pattern


class Split(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"  # dim 0, equal blocks
    ROW = "row"  # dim 1, equal blocks
    VOCAB = "vocab"  # dim 0, equal blocks of the vocabulary
    Q_HEADS = "q_heads"  # dim 0, whole query heads per rank
    KV_HEADS = "kv_heads"  # dim 0, whole kv heads per rank (GQA replication past kv heads)
    O_HEADS = "o_heads"  # dim 1, whole query heads per rank


@dataclass(frozen=True, slots=True)
class Rule:
    pattern: str
    split: Split

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


LLAMA_FAMILY_RULES: Final[tuple[Rule, ...]] = (
    Rule(r"\.self_attn\.q_proj\.(weight|bias)$", Split.Q_HEADS),
    Rule(r"\.self_attn\.(k_proj|v_proj)\.(weight|bias)$", Split.KV_HEADS),
    Rule(r"\.self_attn\.o_proj\.weight$", Split.O_HEADS),
    Rule(r"\.mlp\.(gate_proj|up_proj)\.(weight|bias)$", Split.COLUMN),
    Rule(r"\.mlp\.down_proj\.weight$", Split.ROW),
    Rule(r"\.(o_proj|down_proj)\.bias$", Split.REPLICATED),
    Rule(r"(^|\.)(embed_tokens|lm_head)\.weight$", Split.VOCAB),
    Rule(r"(^|\.)[a-z_]*norm\.(weight|bias)$", Split.REPLICATED),
    Rule(r"(^|\.)rotary_emb\.inv_freq$", Split.REPLICATED),
)

#: Architectures (config.json ``architectures[0]``, else ``model_type``) with rules.
LLAMA_FAMILY_ARCHITECTURES: Final = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
LLAMA_FAMILY_MODEL_TYPES: Final = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class ArchRules:
    """The rules that apply to one checkpoint: a family's table and its head counts."""

    family: str
    rules: tuple[Rule, ...]
    attention: AttentionShape | None

    def split_for(self, name: str) -> Split | None:
        for rule in self.rules:
            if rule.matches(name):
                return rule.split
        return None


def _positive_int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None and default is not None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError("config.json", f"field {key!r} must be a positive integer, got {value!r}")
    return value


def rules_for(config: Mapping[str, Any]) -> ArchRules | None:
    """The sharding rules for a config, or None when its architecture has none."""
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch in LLAMA_FAMILY_ARCHITECTURES or (
        arch is None and config.get("model_type") in LLAMA_FAMILY_MODEL_TYPES
    ):
        heads = _positive_int(config, "num_attention_heads")
        kv = _positive_int(config, "num_key_value_heads", heads)
        hidden = _positive_int(config, "hidden_size")
        head_dim = _positive_int(
            config, "head_dim", hidden // heads if hidden % heads == 0 else None
        )
        if heads % kv:
            raise ConfigError(
                "config.json",
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}",
            )
        return ArchRules("llama", LLAMA_FAMILY_RULES, AttentionShape(heads, kv, head_dim))
    return None


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """One tensor as one rank receives it."""

    name: str
    dtype: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    shard: str
    split_dim: int  # meaningful only when not replicated
    replicated: bool
    pattern: RunPattern

    @property
    def nbytes(self) -> int:
        return self.pattern.nbytes


@dataclass(frozen=True, slots=True)
class RankPlan:
    model: str
    world_size: int
    rank: int
    slices: tuple[TensorSlice, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)


def check_layout(world_size: int, rank: int) -> None:
    if world_size < 1:
        raise InvalidRequest(f"world_size {world_size} is invalid: it must be at least 1")
    if not 0 <= rank < world_size:
        raise InvalidRequest(
            f"rank {rank} is outside world_size {world_size} (valid: 0..{world_size - 1})"
        )


def _divide(t: TensorInfo, dim: int, world_size: int, what: str = "") -> int:
    if len(t.shape) <= dim:
        raise ShardingError(
            f"tensor {t.name!r} has shape {list(t.shape)}; its rule splits dim {dim}, "
            "which it lacks"
        )
    size = t.shape[dim]
    if size % world_size:
        raise ShardingError(
            f"tensor {t.name!r}: dim {dim} of size {size}{what} is not divisible by "
            f"world_size {world_size}"
        )
    return size // world_size


def _heads(t: TensorInfo, count: int, head_dim: int, dim: int, field: str) -> None:
    if len(t.shape) <= dim or t.shape[dim] != count * head_dim:
        raise ShardingError(
            f"tensor {t.name!r}: shape {list(t.shape)} disagrees with config {field}={count} "
            f"x head_dim={head_dim} on dim {dim}"
        )


def _attention(rules: ArchRules | None, t: TensorInfo) -> AttentionShape:
    if rules is None or rules.attention is None:
        raise ShardingError(f"tensor {t.name!r}: its rule needs attention head counts")
    return rules.attention


def slice_tensor(
    t: TensorInfo, split: Split, rules: ArchRules | None, world_size: int, rank: int
) -> TensorSlice:
    """Where rank ``rank`` of ``world_size`` finds its part of ``t``, checked."""
    bits = DTYPE_BITS[t.dtype]
    if split is Split.REPLICATED or world_size == 1:
        return TensorSlice(
            t.name, t.dtype, t.shape, t.shape, t.shard, 0, True, whole_pattern(t.offset, t.nbytes)
        )
    dim = 1 if split in (Split.ROW, Split.O_HEADS) else 0
    if split in (Split.Q_HEADS, Split.O_HEADS, Split.KV_HEADS):
        att = _attention(rules, t)
        if att.num_heads % world_size:
            raise ShardingError(
                f"tensor {t.name!r}: num_attention_heads={att.num_heads} is not divisible by "
                f"world_size {world_size}"
            )
    if split is Split.KV_HEADS:
        att = _attention(rules, t)
        _heads(t, att.num_kv_heads, att.head_dim, 0, "num_key_value_heads")
        kv = att.num_kv_heads
        if world_size <= kv:
            if kv % world_size:
                raise ShardingError(
                    f"tensor {t.name!r}: num_key_value_heads={kv} is not divisible by "
                    f"world_size {world_size}"
                )
            per = t.shape[0] // world_size
            start = rank * per
        else:
            if world_size % kv:
                raise ShardingError(
                    f"tensor {t.name!r}: world_size {world_size} exceeds num_key_value_heads={kv} "
                    "and is not a multiple of it, so kv heads cannot be replicated evenly"
                )
            per = att.head_dim
            start = (rank // (world_size // kv)) * per
    else:
        if split in (Split.Q_HEADS, Split.O_HEADS):
            att = _attention(rules, t)
            _heads(t, att.num_heads, att.head_dim, dim, "num_attention_heads")
        per = _divide(t, dim, world_size)
        start = rank * per
    shape = list(t.shape)
    shape[dim] = per
    try:
        pattern = block_pattern(t.offset, t.shape, bits, dim, [(start, start + per)])
    except ValueError as exc:
        raise ShardingError(
            f"tensor {t.name!r} ({t.dtype} {list(t.shape)}) cannot be split for world_size "
            f"{world_size}: {exc}"
        ) from None
    return TensorSlice(t.name, t.dtype, t.shape, tuple(shape), t.shard, dim, False, pattern)


def plan_rank(
    ckpt: Checkpoint,
    rules: ArchRules | None,
    world_size: int,
    rank: int,
    names: Sequence[str] = (),
) -> RankPlan:
    """Every slice rank ``rank`` of ``world_size`` receives, or the first reason it can't."""
    check_layout(world_size, rank)
    if names:
        seen: set[str] = set()
        for n in names:
            if n not in ckpt.tensors:
                raise TensorNotFound(f"model {ckpt.name!r} has no tensor {n!r}")
            if n in seen:
                raise InvalidRequest(f"tensor {n!r} is requested twice")
            seen.add(n)
        chosen = [ckpt.tensors[n] for n in names]
    else:
        chosen = list(ckpt.tensors.values())
    if world_size > 1 and rules is None:
        arch = ckpt.architecture or ckpt.config.get("model_type") or "unknown"
        raise NoShardingRules(
            f"model {ckpt.name!r} has architecture {arch!r}, which has no tensor-parallel "
            f"rules; only world_size 1 is served (asked for {world_size})"
        )
    slices = []
    for t in chosen:
        split = Split.REPLICATED
        if world_size > 1:
            assert rules is not None  # checked above
            found = rules.split_for(t.name)
            if found is None:
                raise ShardingError(
                    f"tensor {t.name!r} matches no {rules.family}-family sharding rule; refusing "
                    f"to replicate it silently at world_size {world_size}"
                )
            split = found
        slices.append(slice_tensor(t, split, rules, world_size, rank))
    return RankPlan(ckpt.name, world_size, rank, tuple(slices))
