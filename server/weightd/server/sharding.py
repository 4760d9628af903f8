"""The planner: which tensors a worker of a layout receives, and which bytes of each. Pure.

``plan(ckpt, rules, layout, names)`` either returns every slice the worker needs (its
shape and the byte runs to read) or raises naming the first tensor that cannot be
placed or cut; nothing is read and no global is consulted, so a plan is checked
whole before a byte moves. ``plan_rank(ckpt, rules, world_size, rank)`` is the
tensor-parallel-only shorthand.

For each tensor, in checkpoint order:

1. **Rule.** The first rule of the architecture's table whose pattern matches the
   name. With any parallelism, a tensor no rule matches is an error, never a silent
   replication: an unknown 2-D weight served whole to every rank would load without
   complaint and compute garbage.
2. **Stage (pp).** A tensor inside decoder layer ``i`` goes to the stage running
   layer ``i``; others go where their rule's ``stage`` says (embeddings first, and
   last too when tied; final norm and ``lm_head`` last; rotary buffers everywhere).
3. **Experts (ep).** An expert tensor goes only to the ep rank owning its expert,
   in contiguous blocks of ``num_experts / ep_size``; stacked expert tensors are cut
   along dim 0 instead. Non-expert tensors do not depend on the ep rank.
4. **Cut (tp).** The rule's split names a block (or blocks, for fused tensors) of the
   module's logical output or input dim; ``quant.geometry`` maps it onto the tensor
   (packed, grouped or block-scaled dims), refusing a cut through a packed word, a
   quantization group or a scale block. ``runs.block_pattern`` turns it into bytes.

Tied embeddings: with no tensor under a ``head`` rule (``lm_head.weight``), weightd
serves no ``lm_head.weight`` (it never invents tensors); the embedding's
vocab-parallel slice is exactly the tied head's, and with pipeline parallelism the
last stage receives the embedding too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from weightd.common.dtypes import DTYPE_BITS

from .checkpoint import Checkpoint, TensorInfo
from .errors import (
    InvalidRequest,
    NoShardingRules,
    ShardingError,
    TensorNotFound,
    TensorNotInLayout,
    UnsupportedQuantization,
)
from .layout import Layout, stage_ranges
from .quant import geometry
from .rules import ArchRules, AttentionShape, Experts, Rule, Split, Stage
from .rules_builtin import (
    LLAMA_FAMILY_ARCHITECTURES,
    LLAMA_FAMILY_MODEL_TYPES,
    LLAMA_FAMILY_RULES,
    rules_for,
)
from .runs import RunPattern, block_pattern, whole_pattern
from .tpcut import logical_blocks, physical

__all__ = [
    "LLAMA_FAMILY_ARCHITECTURES",
    "LLAMA_FAMILY_MODEL_TYPES",
    "LLAMA_FAMILY_RULES",
    "ArchRules",
    "AttentionShape",
    "Layout",
    "Partition",
    "RankPlan",
    "Rule",
    "Split",
    "TensorSlice",
    "check_layout",
    "peer_slices",
    "plan",
    "plan_rank",
    "rules_for",
    "slice_tensor",
]


@dataclass(frozen=True, slots=True)
class Partition:
    """The peers among which a tensor is cut, and this slice's place among them.

    ``key`` holds what the cut depends on — ``(tp_size, ep_size)`` for a stacked-expert
    tensor, ``(tp_size, 1)`` otherwise, ``()`` for a whole tensor — so every worker
    whose slice of the tensor comes from the same cut shares it: the daemon anchors
    the digests of all ``count`` peer slices at once (``integrity.SliceAnchors``).
    """

    key: tuple[int, ...]
    index: int
    count: int


WHOLE = Partition((), 0, 1)


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """One tensor as one worker receives it."""

    name: str
    dtype: str
    full_shape: tuple[int, ...]
    shape: tuple[int, ...]
    shard: str
    split_dim: int  # the tensor-parallel dim; meaningful only when not replicated
    replicated: bool  # the whole tensor
    pattern: RunPattern
    partition: Partition = WHOLE

    @property
    def nbytes(self) -> int:
        return self.pattern.nbytes


@dataclass(frozen=True, slots=True)
class RankPlan:
    model: str
    world_size: int  # tensor-parallel size, as in the TP-only shorthand
    rank: int  # tensor-parallel rank
    slices: tuple[TensorSlice, ...]
    layout: Layout = field(default_factory=Layout)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)


def check_layout(world_size: int, rank: int) -> None:
    Layout.tp(world_size, rank).check()


# --- one tensor ------------------------------------------------------------------------


def _cut(
    t: TensorInfo,
    rule: Rule,
    rules: ArchRules | None,
    tensors: Mapping[str, TensorInfo],
    layout: Layout,
) -> TensorSlice:
    """Where this worker finds its part of ``t``, checked. Reads only the layout's sizes
    and ``tp_rank``, and ``ep_rank`` for stacked experts."""
    tp, rank = layout.tp_size, layout.tp_rank
    stacked = rule.experts is Experts.STACKED
    base, shape = t.offset, t.shape
    bits = DTYPE_BITS[t.dtype]
    experts: tuple[int, int] | None = None
    ep_key = 1
    if stacked:
        count = rules.num_experts if rules is not None else None
        if not shape or count is None or shape[0] != count:
            raise ShardingError(
                f"tensor {t.name!r}: shape {list(shape)} should run over the {count} experts "
                "on dim 0 (a stacked-experts rule)"
            )
        if layout.ep_size > 1:
            per = count // layout.ep_size
            experts = (layout.ep_rank * per, (layout.ep_rank + 1) * per)
            ep_key = layout.ep_size
    inner = shape[1:] if stacked else shape
    cut: tuple[int, list[tuple[int, int]]] | None = None
    if tp > 1 and rule.split is not Split.REPLICATED:
        quant = rules.quant if rules is not None else None
        if quant is not None and quant.problem:
            raise UnsupportedQuantization(
                f"tensor {t.name!r}: slicing is not supported for {quant.problem}; only "
                "tensor-parallel world_size 1 is served"
            )
        geo = geometry(t.name, t.dtype, inner, tensors, quant)
        key, blocks = logical_blocks(t.name, t.shape, rule, geo, rules, tp, rank)
        mapped = physical(t.name, geo, key, blocks, rule.split)
        if mapped is not None:
            dim, phys = mapped
            cut = (dim + (1 if stacked else 0), phys)
    if experts is None and cut is None:
        return TensorSlice(
            t.name, t.dtype, t.shape, t.shape, t.shard, 0, True, whole_pattern(t.offset, t.nbytes)
        )
    new_shape = list(shape)
    if experts is not None:
        e0, e1 = experts
        base += e0 * (t.nbytes // shape[0])
        new_shape[0] = e1 - e0
    try:
        if cut is None:
            pattern = block_pattern(base, new_shape, bits, 0, [(0, new_shape[0])])
            split_dim = 0
        else:
            split_dim, phys = cut
            pattern = block_pattern(base, new_shape, bits, split_dim, phys)
            new_shape[split_dim] = sum(b - a for a, b in phys)
    except ValueError as exc:
        raise ShardingError(f"tensor {t.name!r} ({t.dtype} {list(t.shape)}): {exc}") from None
    tp_count = tp if cut is not None else 1
    index = (layout.ep_rank if experts is not None else 0) * tp_count + (
        rank if cut is not None else 0
    )
    partition = Partition((tp_count, ep_key), index, tp_count * ep_key)
    return TensorSlice(
        t.name, t.dtype, t.shape, tuple(new_shape), t.shard, split_dim, False, pattern, partition
    )


def slice_tensor(
    t: TensorInfo, split: Split, rules: ArchRules | None, world_size: int, rank: int
) -> TensorSlice:
    """Where rank ``rank`` of ``world_size`` finds its part of a lone dense tensor ``t``."""
    return _cut(t, Rule("", split), rules, {t.name: t}, Layout.tp(world_size, rank))


# --- membership: stages and experts ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Context:
    layout: Layout
    stages: list[tuple[int, int]] | None  # layer range per stage, when pp > 1
    expert_block: tuple[int, int] | None  # experts owned, when ep > 1
    tied: bool  # no tensor under a "head" rule


def _context(
    ckpt: Checkpoint,
    rules: ArchRules,
    layout: Layout,
    found: Mapping[str, tuple[Rule, re.Match[str]]],
) -> _Context:
    stages = None
    if layout.pp_size > 1:
        if rules.num_layers is None:
            raise ShardingError(
                f"model {ckpt.name!r}: config.json has no layer count ({rules.family} rules), "
                f"so pipeline stages cannot be drawn (asked for pp_size {layout.pp_size})"
            )
        stages = stage_ranges(rules.num_layers, layout.pp_size, layout.pp_layers)
    elif layout.pp_layers and rules.num_layers is not None:
        stage_ranges(rules.num_layers, 1, layout.pp_layers)
    expert_block = None
    if layout.ep_size > 1:
        if rules.num_experts is None:
            raise ShardingError(
                f"model {ckpt.name!r} ({rules.family} rules) has no experts; ep_size must be 1, "
                f"not {layout.ep_size}"
            )
        if rules.num_experts % layout.ep_size:
            raise ShardingError(
                f"model {ckpt.name!r}: num_experts={rules.num_experts} is not divisible by "
                f"ep_size {layout.ep_size}"
            )
        per = rules.num_experts // layout.ep_size
        expert_block = (layout.ep_rank * per, (layout.ep_rank + 1) * per)
    tied = not any(rule.stage is Stage.HEAD for rule, _ in found.values())
    return _Context(layout, stages, expert_block, tied)


def _held(
    t: TensorInfo, rule: Rule, m: re.Match[str], rules: ArchRules, ctx: _Context
) -> str | None:
    """None when this worker holds ``t``; else why not (for a by-name request)."""
    layout = ctx.layout
    if ctx.stages is not None:
        layer = rules.layer_of(t.name)
        if layer is not None:
            what = f"layer {layer}"
            owners = [i for i, (a, b) in enumerate(ctx.stages) if a <= layer < b]
            if not owners:
                raise ShardingError(
                    f"tensor {t.name!r} is in layer {layer}, but the model has "
                    f"num_hidden_layers={rules.num_layers}: no pipeline stage runs it"
                )
        elif rule.stage is None:
            raise ShardingError(
                f"tensor {t.name!r} lies outside the decoder layers and its {rules.family} rule "
                f"names no pipeline stage (pp_size {layout.pp_size})"
            )
        else:
            what = f"a {rule.stage.value} tensor"
            last = layout.pp_size - 1
            owners = {
                Stage.FIRST: [0],
                Stage.LAST: [last],
                Stage.HEAD: [last],
                Stage.ALL: list(range(layout.pp_size)),
                Stage.EMBEDDING: [0, last] if ctx.tied else [0],
            }[rule.stage]
        if layout.pp_rank not in owners:
            stages = " and ".join(str(o) for o in owners)
            return f"it belongs to pipeline stage {stages} ({what})"
    if rule.experts is Experts.INDEXED:
        expert = int(m.group("expert"))
        count = rules.num_experts
        if count is None or expert >= count:
            raise ShardingError(
                f"tensor {t.name!r} names expert {expert}, but the model has num_experts={count}"
            )
        if ctx.expert_block is not None and not ctx.expert_block[0] <= expert < ctx.expert_block[1]:
            per = ctx.expert_block[1] - ctx.expert_block[0]
            return f"expert {expert} belongs to ep rank {expert // per}"
    return None


# --- plans -----------------------------------------------------------------------------


def _rules_or_fail(ckpt: Checkpoint, rules: ArchRules | None, layout: Layout) -> ArchRules:
    if rules is None:
        arch = ckpt.architecture or ckpt.config.get("model_type") or "unknown"
        ask = str(layout.tp_size) if layout.world_size == layout.tp_size else layout.describe()
        raise NoShardingRules(
            f"model {ckpt.name!r} has architecture {arch!r}, which has no sharding rules; only "
            f"world_size 1 is served (asked for {ask})"
        )
    return rules


def _match_all(
    ckpt: Checkpoint, rules: ArchRules, layout: Layout
) -> dict[str, tuple[Rule, re.Match[str]]]:
    found: dict[str, tuple[Rule, re.Match[str]]] = {}
    for t in ckpt.tensors.values():
        hit = rules.rule_for(t.name)
        if hit is None:
            where = (
                f"world_size {layout.tp_size}"
                if layout.world_size == layout.tp_size
                else f"layout {layout.describe()}"
            )
            raise ShardingError(
                f"tensor {t.name!r} matches no {rules.family}-family sharding rule; refusing "
                f"to replicate it silently at {where}"
            )
        found[t.name] = hit
    return found


def plan(
    ckpt: Checkpoint, rules: ArchRules | None, layout: Layout, names: Sequence[str] = ()
) -> RankPlan:
    """Every slice the worker at ``layout`` receives, or the first reason it can't.

    Every tensor must match a rule and the layout must fit the model (stages, expert
    count) even when ``names`` asks for a few; only the named tensors are cut.
    """
    layout.check()
    if names:
        seen: set[str] = set()
        for n in names:
            if n not in ckpt.tensors:
                raise TensorNotFound(f"model {ckpt.name!r} has no tensor {n!r}")
            if n in seen:
                raise InvalidRequest(f"tensor {n!r} is requested twice")
            seen.add(n)
    if layout.is_trivial:
        chosen = [ckpt.tensors[n] for n in names] if names else list(ckpt.tensors.values())
        slices = tuple(
            TensorSlice(
                t.name,
                t.dtype,
                t.shape,
                t.shape,
                t.shard,
                0,
                True,
                whole_pattern(t.offset, t.nbytes),
            )
            for t in chosen
        )
        return RankPlan(ckpt.name, 1, 0, slices, layout)
    arch = _rules_or_fail(ckpt, rules, layout)
    found = _match_all(ckpt, arch, layout)
    ctx = _context(ckpt, arch, layout, found)
    chosen = [ckpt.tensors[n] for n in names] if names else list(ckpt.tensors.values())
    out: list[TensorSlice] = []
    for t in chosen:
        rule, m = found[t.name]
        why = _held(t, rule, m, arch, ctx)
        if why is None:
            out.append(_cut(t, rule, arch, ckpt.tensors, layout))
        elif names:
            raise TensorNotInLayout(f"tensor {t.name!r} is not held at {layout.describe()}: {why}")
    slices = tuple(out)
    return RankPlan(ckpt.name, layout.tp_size, layout.tp_rank, slices, layout)


def plan_rank(
    ckpt: Checkpoint,
    rules: ArchRules | None,
    world_size: int,
    rank: int,
    names: Sequence[str] = (),
) -> RankPlan:
    """Every slice rank ``rank`` of a tensor-parallel ``world_size`` receives."""
    return plan(ckpt, rules, Layout.tp(world_size, rank), names)


def peer_slices(
    ckpt: Checkpoint, rules: ArchRules | None, s: TensorSlice, layout: Layout
) -> list[TensorSlice]:
    """Every peer slice of ``s`` (same tensor, same cut), in ``s.partition.index`` order.

    The service anchors all of them from one read of the whole tensor; a tensor held
    whole has one peer, itself.
    """
    if s.partition.count == 1:
        return [s]
    assert rules is not None  # a cut tensor was planned with rules
    t = ckpt.tensors[s.name]
    hit = rules.rule_for(t.name)
    assert hit is not None
    tp_count, ep_count = s.partition.key
    out = []
    for index in range(s.partition.count):
        peer = Layout(
            tp_size=layout.tp_size,
            tp_rank=index % tp_count if tp_count > 1 else 0,
            ep_size=layout.ep_size,
            ep_rank=index // tp_count if ep_count > 1 else 0,
        )
        out.append(_cut(t, hit[0], rules, ckpt.tensors, peer))
    return out
