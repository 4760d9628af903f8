"""Which worker of a layout holds a tensor: pipeline stages and expert blocks. Pure.

Steps 2 and 3 of the planner (see ``planner``). :func:`membership_of` checks the
layout against the model once (a layer count for ``pp``, an expert count dividing
``ep``) and draws the stages' layer ranges and this worker's expert block;
:func:`held` then says, tensor by tensor, whether the worker holds it, or why not.

Kept apart from ``planner.py`` (which runs the steps in order) and ``slices.py``
(which cuts the bytes): membership is decided from names, rules and the layout
alone, never from a tensor's dtype, shape or offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..base.errors import ShardingError
from ..base.patterns import Match
from ..checkpoint.description import Checkpoint, TensorInfo
from .layout import Layout, stage_ranges
from .rules import ArchRules, Experts, Rule, Stage


@dataclass(frozen=True, slots=True)
class Membership:
    layout: Layout
    stages: list[tuple[int, int]] | None  # layer range per stage, when pp > 1
    expert_block: tuple[int, int] | None  # experts owned, when ep > 1
    tied: bool  # no tensor under a "head" rule


def membership_of(
    ckpt: Checkpoint,
    rules: ArchRules,
    layout: Layout,
    found: Mapping[str, tuple[Rule, Match]],
) -> Membership:
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
    return Membership(layout, stages, expert_block, tied)


def held(t: TensorInfo, rule: Rule, m: Match, rules: ArchRules, ctx: Membership) -> str | None:
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
        group = m.group("expert")
        if group is None:
            raise ShardingError(
                f"tensor {t.name!r} matches expert rule {rule.pattern!r}, whose (?P<expert>...) "
                "group did not take part in the match"
            )
        expert = int(group)
        count = rules.num_experts
        if count is None or expert >= count:
            raise ShardingError(
                f"tensor {t.name!r} names expert {expert}, but the model has num_experts={count}"
            )
        if ctx.expert_block is not None and not ctx.expert_block[0] <= expert < ctx.expert_block[1]:
            per = ctx.expert_block[1] - ctx.expert_block[0]
            return f"expert {expert} belongs to ep rank {expert // per}"
    return None
