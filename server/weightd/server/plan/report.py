"""``weightd plan``: every worker's share of a checkpoint under a layout, before serving it.

:func:`report` is pure (plans in, numbers out); :func:`run_plan` reads only the
checkpoint's headers (no tensor bytes, no hashing) and prints. Per worker it gives
the tensors and bytes it receives, that as a fraction of the checkpoint, and the
bytes its slices touch on disk: the span from the first to the last byte each
slice reads (a row-parallel slice reads a few bytes of every row, so it touches
nearly the whole tensor even though it receives a fraction of it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..checkpoint.description import Checkpoint
from ..checkpoint.scan import load_checkpoint
from .builtin_rules import rules_for
from .layout import Layout, every_rank, stage_ranges
from .planner import RankPlan, plan
from .rules import ArchRules
from .rules_file import load_rules_file


@dataclass(frozen=True, slots=True)
class RankReport:
    layout: Layout
    #: (name, dtype, slice shape, bytes, disk span) of each tensor the worker receives
    tensors: tuple[tuple[str, str, tuple[int, ...], int, int], ...]
    nbytes: int
    span: int


@dataclass(frozen=True, slots=True)
class PlanReport:
    model: str
    architecture: str
    family: str
    checkpoint_bytes: int
    num_tensors: int
    stages: tuple[tuple[int, int], ...]
    ranks: tuple[RankReport, ...]

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)


def rank_report(p: RankPlan) -> RankReport:
    tensors = tuple((s.name, s.dtype, s.shape, s.nbytes, s.pattern.span) for s in p.slices)
    return RankReport(p.layout, tensors, p.nbytes, sum(t[4] for t in tensors))


def report(
    ckpt: Checkpoint,
    rules: ArchRules | None,
    tp: int,
    pp: int = 1,
    ep: int = 1,
    pp_layers: Sequence[int] = (),
    vocab_pad: int = 0,
) -> PlanReport:
    """Plan every worker of the layout; the first that cannot be planned raises."""
    ranks = tuple(
        rank_report(plan(ckpt, rules, lay)) for lay in every_rank(tp, pp, ep, pp_layers, vocab_pad)
    )
    stages: tuple[tuple[int, int], ...] = ()
    if pp > 1 and rules is not None and rules.num_layers is not None:
        stages = tuple(stage_ranges(rules.num_layers, pp, pp_layers))
    return PlanReport(
        ckpt.name,
        ckpt.architecture,
        "none" if rules is None else f"{rules.family} ({rules.source})",
        ckpt.total_bytes,
        len(ckpt.tensors),
        stages,
        ranks,
    )


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def as_json(r: PlanReport) -> dict[str, Any]:
    return {
        "model": r.model,
        "architecture": r.architecture,
        "rules": r.family,
        "checkpoint_bytes": r.checkpoint_bytes,
        "num_tensors": r.num_tensors,
        "stages": [list(s) for s in r.stages],
        "vocab_pad": r.ranks[0].layout.vocab_pad,
        "total_bytes": r.total_bytes,
        "ranks": [
            {
                "rank": k.layout.global_rank,
                "tp_rank": k.layout.tp_rank,
                "pp_rank": k.layout.pp_rank,
                "ep_rank": k.layout.ep_rank,
                "num_tensors": len(k.tensors),
                "bytes": k.nbytes,
                "fraction_of_checkpoint": _fraction(k.nbytes, r.checkpoint_bytes),
                "disk_span_bytes": k.span,
                "tensors": [
                    {"name": n, "dtype": d, "shape": list(s), "bytes": b, "disk_span_bytes": sp}
                    for n, d, s, b, sp in k.tensors
                ],
            }
            for k in r.ranks
        ],
    }


def as_text(r: PlanReport, tensors: bool = False) -> str:
    first = r.ranks[0].layout
    lines = [
        f"{r.model} ({r.architecture or 'no architecture'}; rules: {r.family}): "
        f"{r.num_tensors} tensors, {r.checkpoint_bytes} bytes",
        f"layout: tp={first.tp_size} pp={first.pp_size} ep={first.ep_size} "
        + (f"vocab_pad={first.vocab_pad} " if first.vocab_pad else "")
        + f"({len(r.ranks)} workers)",
    ]
    if r.stages:
        drawn = [f"{i}: layers {a}..{b - 1}" for i, (a, b) in enumerate(r.stages)]
        lines.append("stages: " + " | ".join(drawn))
    lines.append(
        f"{'rank':>5} {'pp':>3} {'ep':>3} {'tp':>3} {'tensors':>8} {'bytes':>14} "
        f"{'of ckpt':>8} {'disk span':>14}"
    )
    for k in r.ranks:
        lay = k.layout
        lines.append(
            f"{lay.global_rank:>5} {lay.pp_rank:>3} {lay.ep_rank:>3} {lay.tp_rank:>3} "
            f"{len(k.tensors):>8} {k.nbytes:>14} {_fraction(k.nbytes, r.checkpoint_bytes):>8.1%} "
            f"{k.span:>14}"
        )
        if tensors:
            for name, dtype, shape, nbytes, span in k.tensors:
                lines.append(f"        {name}\t{dtype}\t{list(shape)}\t{nbytes}\t(span {span})")
    lines.append(
        f"total over workers: {r.total_bytes} bytes = "
        f"{_fraction(r.total_bytes, r.checkpoint_bytes):.2f} x the checkpoint"
    )
    return "\n".join(lines)


def run_plan(
    directory: str,
    tp: int,
    pp: int = 1,
    ep: int = 1,
    pp_layers: Sequence[int] = (),
    rules_files: Sequence[str] = (),
    json_out: bool = False,
    tensors: bool = False,
    vocab_pad: int = 0,
) -> str:
    """What ``weightd plan`` prints. Reads headers only; errors propagate as WeightdError."""
    tables = [load_rules_file(p) for p in rules_files]
    ckpt, store = load_checkpoint(directory)
    store.close()  # headers are all a plan needs
    r = report(ckpt, rules_for(ckpt.config, tables), tp, pp, ep, pp_layers, vocab_pad)
    return json.dumps(as_json(r), indent=2) if json_out else as_text(r, tensors)
