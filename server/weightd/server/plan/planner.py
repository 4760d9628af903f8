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

This module runs the steps in order and holds step 1; steps 2 and 3 (whether a
worker holds a tensor) are ``membership``, step 4 (which bytes of it) is ``slices``,
where ``TensorSlice``, ``slice_tensor`` and ``peer_slices`` live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..base.errors import (
    InvalidRequest,
    NoShardingRules,
    ShardingError,
    TensorNotFound,
    TensorNotInLayout,
    echo,
)
from ..base.patterns import Match
from ..checkpoint.description import Checkpoint
from ..store.runs import whole_pattern
from .layout import Layout
from .membership import held, membership_of
from .rules import ArchRules, Rule
from .slices import TensorSlice, cut_tensor


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


# --- plans -----------------------------------------------------------------------------


def rules_or_fail(ckpt: Checkpoint, rules: ArchRules | None, layout: Layout) -> ArchRules:
    if rules is None:
        arch = ckpt.architecture or ckpt.config.get("model_type") or "unknown"
        ask = str(layout.tp_size) if layout.world_size == layout.tp_size else layout.describe()
        raise NoShardingRules(
            f"model {ckpt.name!r} has architecture {arch!r}, which has no sharding rules; only "
            f"world_size 1 is served (asked for {ask})"
        )
    return rules


def _match_all(ckpt: Checkpoint, rules: ArchRules, layout: Layout) -> dict[str, tuple[Rule, Match]]:
    found: dict[str, tuple[Rule, Match]] = {}
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
                raise TensorNotFound(
                    f"model {ckpt.name!r} has no tensor {echo(n)}", model=ckpt.name, tensor=n
                )
            if n in seen:
                raise InvalidRequest(f"tensor {echo(n)} is requested twice")
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
    arch = rules_or_fail(ckpt, rules, layout)
    found = _match_all(ckpt, arch, layout)
    ctx = membership_of(ckpt, arch, layout, found)
    chosen = [ckpt.tensors[n] for n in names] if names else list(ckpt.tensors.values())
    out: list[TensorSlice] = []
    for t in chosen:
        rule, m = found[t.name]
        why = held(t, rule, m, arch, ctx)
        if why is None:
            out.append(cut_tensor(t, rule, arch, ckpt.tensors, layout))
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
