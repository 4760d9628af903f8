"""One tensor as one worker receives it: its shape, its byte runs, its peers. Pure.

Step 4 of the planner (see ``planner``): given the rule a tensor matched and a
worker's layout, :func:`cut_tensor` works out the worker's part of that one tensor:
the tensor-parallel cut (``tpcut`` blocks mapped through ``quant.geometry``), the
expert block of a stacked-experts tensor, and the byte runs (``runs``) to read.
:func:`peer_slices` repeats the cut for every peer of the same partition.

Kept apart from ``planner.py``, which decides *which* tensors a worker receives
(rules, stages, experts): this module decides *which bytes* of one tensor, and is
all the dims, dtypes and offsets arithmetic. The service (anchoring peer slices),
packs and adapters need the slice types and the cut without a whole plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from weightd.common.dtypes import DTYPE_BITS

from ..base.errors import ShardingError, UnsupportedQuantization
from ..checkpoint.description import Checkpoint, TensorInfo
from ..store.runs import RunPattern, block_pattern, whole_pattern
from .layout import Layout
from .quant import geometry
from .rules import ArchRules, Experts, Rule, Split
from .tpcut import logical_blocks, physical, uneven_vocab


@dataclass(frozen=True, slots=True)
class Partition:
    """The peers among which a tensor is cut, and this slice's place among them.

    ``key`` holds what the cut depends on — ``(tp_size, ep_size)`` for a stacked-expert
    tensor, ``(tp_size, 1)`` otherwise, ``(tp_size, 1, vocab_pad)`` for a vocabulary
    that ``vocab_pad`` cuts unevenly, ``()`` for a whole tensor — so every worker
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


def cut_tensor(
    t: TensorInfo,
    rule: Rule,
    rules: ArchRules | None,
    tensors: Mapping[str, TensorInfo],
    layout: Layout,
) -> TensorSlice:
    """Where this worker finds its part of ``t``, checked. Reads only the layout's sizes,
    ``tp_rank`` and ``vocab_pad``, and ``ep_rank`` for stacked experts."""
    tp, rank = layout.tp_size, layout.tp_rank
    stacked = rule.experts is Experts.STACKED
    base, shape = t.offset, t.shape
    bits = DTYPE_BITS[t.dtype]
    experts: tuple[int, int] | None = None
    ep_key = 1
    pad_key: tuple[int, ...] = ()
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
        key, blocks = logical_blocks(t.name, t.shape, rule, geo, rules, tp, rank, layout.vocab_pad)
        if uneven_vocab(rule.split, geo.out_size, layout.vocab_pad):
            pad_key = (layout.vocab_pad,)
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
    partition = Partition((tp_count, ep_key, *pad_key), index, tp_count * ep_key)
    return TensorSlice(
        t.name, t.dtype, t.shape, tuple(new_shape), t.shard, split_dim, False, pattern, partition
    )


def slice_tensor(
    t: TensorInfo, split: Split, rules: ArchRules | None, world_size: int, rank: int
) -> TensorSlice:
    """Where rank ``rank`` of ``world_size`` finds its part of a lone dense tensor ``t``."""
    return cut_tensor(t, Rule("", split), rules, {t.name: t}, Layout.tp(world_size, rank))


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
    tp_count, ep_count = s.partition.key[:2]
    out = []
    for index in range(s.partition.count):
        peer = Layout(
            tp_size=layout.tp_size,
            tp_rank=index % tp_count if tp_count > 1 else 0,
            ep_size=layout.ep_size,
            ep_rank=index // tp_count if ep_count > 1 else 0,
            vocab_pad=layout.vocab_pad,
        )
        out.append(cut_tensor(t, hit[0], rules, ckpt.tensors, peer))
    return out
