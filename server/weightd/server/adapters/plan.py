"""Which bytes of an adapter a tensor-parallel rank receives. Pure.

A LoRA pair follows its base layer's cut, so the rank's ``B @ A @ x`` lands exactly
where its base slice's output does:

* base cut on its **output** dim (column-parallel, q/k/v heads, fused parts):
  ``lora_B`` (``[out, r]``) gets the same output blocks as the base's rows, and
  ``lora_A`` is replicated. GQA k/v past the kv-head count and fused layers come out
  right because the blocks are the base rule's own (``tpcut.logical_blocks``).
* base cut on its **input** dim (row-parallel, o heads): ``lora_A`` (``[r, in]``)
  gets the base's input blocks as columns, ``lora_B`` is replicated; the rank's
  partial ``B @ A_rank @ x_rank`` terms sum in the same all-reduce as the base's.
* base replicated: both whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from weightd.common.dtypes import DTYPE_BITS

from ..base.errors import ShardingError
from ..checkpoint.description import Checkpoint, TensorInfo
from ..plan.layout import Layout
from ..plan.planner import check_layout, rules_or_fail
from ..plan.quant import geometry
from ..plan.rules import ArchRules, Split
from ..plan.slices import Partition, TensorSlice
from ..plan.tpcut import logical_blocks
from ..store.runs import block_pattern, whole_pattern
from .validate import AdapterModule


@dataclass(frozen=True, slots=True)
class AdapterSlicePlan:
    """Every slice of one adapter a rank receives, named ``<module>.lora_{A,B}.weight``."""

    world_size: int
    rank: int
    slices: tuple[TensorSlice, ...]
    scaling: dict[str, float]  # module -> alpha / r (or / sqrt(r) with rsLoRA)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)


def served_name(module: str, half: str) -> str:
    return f"{module}.{half}.weight"


def _whole(t: TensorInfo, name: str) -> TensorSlice:
    return TensorSlice(
        name, t.dtype, t.shape, t.shape, t.shard, 0, True, whole_pattern(t.offset, t.nbytes)
    )


def _cut(
    t: TensorInfo, name: str, dim: int, blocks: Sequence[tuple[int, int]], tp: int, rank: int
) -> TensorSlice:
    shape = list(t.shape)
    try:
        pattern = block_pattern(t.offset, shape, DTYPE_BITS[t.dtype], dim, blocks)
    except ValueError as exc:
        raise ShardingError(f"adapter tensor {t.name!r}: {exc}") from None
    shape[dim] = sum(b - a for a, b in blocks)
    return TensorSlice(
        name,
        t.dtype,
        t.shape,
        tuple(shape),
        t.shard,
        dim,
        False,
        pattern,
        Partition((tp, 1), rank, tp),
    )


def plan_adapter(
    modules: Sequence[AdapterModule],
    base: Checkpoint,
    rules: ArchRules | None,
    world_size: int,
    rank: int,
) -> AdapterSlicePlan:
    """The slices rank ``rank`` of ``world_size`` needs, or the first reason it can't."""
    check_layout(world_size, rank)
    scaling = {m.module: m.scaling for m in modules}
    out: list[TensorSlice] = []
    arch = rules_or_fail(base, rules, Layout.tp(world_size, rank)) if world_size > 1 else None
    for m in modules:
        a_name, b_name = served_name(m.module, "lora_A"), served_name(m.module, "lora_B")
        hit = arch.rule_for(m.base_tensor) if arch is not None else None
        if arch is not None and hit is None:
            raise ShardingError(
                f"adapter module {m.module!r}: base tensor {m.base_tensor!r} matches no "
                f"{arch.family}-family sharding rule"
            )
        if arch is None or hit is None or hit[0].split is Split.REPLICATED:
            out += [_whole(m.a, a_name), _whole(m.b, b_name)]
            continue
        t = base.tensors[m.base_tensor]
        geo = geometry(t.name, t.dtype, t.shape, base.tensors, arch.quant)
        key, blocks = logical_blocks(t.name, t.shape, hit[0], geo, arch, world_size, rank)
        if key == "out":
            out += [_whole(m.a, a_name), _cut(m.b, b_name, 0, blocks, world_size, rank)]
        else:
            out += [_cut(m.a, a_name, 1, blocks, world_size, rank), _whole(m.b, b_name)]
    return AdapterSlicePlan(world_size, rank, tuple(out), scaling)
