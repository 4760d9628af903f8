"""Tensor-parallel cuts of one tensor: logical blocks of its module, mapped onto its dims. Pure.

A split (``rules.Split``) names, for a rank, blocks of the module's logical output
or input dim: equal blocks, whole query heads, whole kv heads (replicated past the
kv-head count), or one block per part of a fused tensor (Phi-3 ``qkv_proj`` gets
its q, k and v heads; ``gate_up_proj`` each half). :func:`physical` maps those
blocks onto the tensor through its ``quant.Geometry``, refusing any boundary that
would cut a packed word, a quantization group or a scale block.
"""

from __future__ import annotations

from ..base.errors import QuantizationSplitError, ShardingError
from .quant import Axis, Geometry
from .rules import ArchRules, AttentionShape, Rule, Split


def _attention(rules: ArchRules | None, name: str) -> AttentionShape:
    if rules is None or rules.attention is None:
        raise ShardingError(f"tensor {name!r}: its rule needs attention head counts")
    return rules.attention


def _where(name: str, axis: Axis, axis_word: str, geo: Geometry) -> str:
    if axis.unit == 1 and geo.label == "dense":
        return f"tensor {name!r}: dim {axis.dim}"
    return f"tensor {name!r} ({geo.label}): its {axis_word} dim"


def _even(where: str, size: int, tp: int, rank: int) -> list[tuple[int, int]]:
    if size % tp:
        raise ShardingError(
            f"{where} of size {size} is not divisible by tensor-parallel world_size {tp}"
        )
    per = size // tp
    return [(rank * per, (rank + 1) * per)]


def _check_heads(
    name: str, shape: tuple[int, ...], size: int, count: int, head_dim: int, dim: object, field: str
) -> None:
    if size != count * head_dim:
        raise ShardingError(
            f"tensor {name!r}: shape {list(shape)} disagrees with config {field}={count} x "
            f"head_dim={head_dim} on dim {dim}"
        )


def _q_heads(name: str, att: AttentionShape, tp: int) -> None:
    if att.num_heads % tp:
        raise ShardingError(
            f"tensor {name!r}: num_attention_heads={att.num_heads} is not divisible by "
            f"tensor-parallel world_size {tp}"
        )


def _kv_block(name: str, att: AttentionShape, tp: int, rank: int) -> tuple[int, int]:
    """The kv heads (as a ``[start, stop)`` of rows) rank ``rank`` attends with."""
    kv, hd = att.num_kv_heads, att.head_dim
    if tp <= kv:
        if kv % tp:
            raise ShardingError(
                f"tensor {name!r}: num_key_value_heads={kv} is not divisible by "
                f"tensor-parallel world_size {tp}"
            )
        per = kv // tp * hd
        return rank * per, (rank + 1) * per
    if tp % kv:
        raise ShardingError(
            f"tensor {name!r}: tensor-parallel world_size {tp} exceeds num_key_value_heads={kv} "
            "and is not a multiple of it, so kv heads cannot be replicated evenly"
        )
    head = rank // (tp // kv)
    return head * hd, (head + 1) * hd


def logical_blocks(
    name: str,
    shape: tuple[int, ...],
    rule: Rule,
    geo: Geometry,
    rules: ArchRules | None,
    tp: int,
    rank: int,
) -> tuple[str, list[tuple[int, int]]]:
    """Which logical axis (``"out"``/``"in"``) the split cuts, and this rank's blocks of it."""
    split = rule.split
    axis_word = "input" if split in (Split.ROW, Split.O_HEADS) else "output"
    axis = geo.inn if axis_word == "input" else geo.out
    size = geo.in_size if axis_word == "input" else geo.out_size
    if axis.missing:
        raise ShardingError(
            f"tensor {name!r} has shape {list(shape)}; its rule splits dim "
            f"{1 if axis_word == 'input' else 0} ({axis_word}), which it lacks"
        )
    where = _where(name, axis, axis_word, geo)
    key = "in" if axis_word == "input" else "out"
    dim_label = axis.dim if geo.label == "dense" else axis_word
    if split in (Split.COLUMN, Split.VOCAB, Split.ROW):
        return key, _even(where, size, tp, rank)
    if split is Split.FUSED:
        if size % rule.parts:
            raise ShardingError(f"{where} of size {size} is not {rule.parts} equal fused parts")
        part = size // rule.parts
        if part % tp:
            raise ShardingError(
                f"{where}: each of its {rule.parts} fused parts has size {part}, not divisible "
                f"by tensor-parallel world_size {tp}"
            )
        per = part // tp
        return key, [
            (i * part + rank * per, i * part + (rank + 1) * per) for i in range(rule.parts)
        ]
    att = _attention(rules, name)
    _q_heads(name, att, tp)
    if split in (Split.Q_HEADS, Split.O_HEADS):
        _check_heads(
            name, shape, size, att.num_heads, att.head_dim, dim_label, "num_attention_heads"
        )
        per = size // tp
        return key, [(rank * per, (rank + 1) * per)]
    if split is Split.KV_HEADS:
        _check_heads(
            name, shape, size, att.num_kv_heads, att.head_dim, dim_label, "num_key_value_heads"
        )
        return key, [_kv_block(name, att, tp, rank)]
    assert split is Split.QKV_HEADS
    q_rows, kv_rows = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    if size != q_rows + 2 * kv_rows:
        raise ShardingError(
            f"tensor {name!r}: shape {list(shape)} on dim {dim_label} disagrees with config "
            f"(num_attention_heads={att.num_heads} + 2 x num_key_value_heads={att.num_kv_heads})"
            f" x head_dim={att.head_dim}"
        )
    per = q_rows // tp
    k0, k1 = _kv_block(name, att, tp, rank)
    return key, [
        (rank * per, (rank + 1) * per),
        (q_rows + k0, q_rows + k1),
        (q_rows + kv_rows + k0, q_rows + kv_rows + k1),
    ]


def physical(
    name: str, geo: Geometry, key: str, blocks: list[tuple[int, int]], split: Split
) -> tuple[int, list[tuple[int, int]]] | None:
    """Map logical blocks onto the tensor's dim; None when the tensor does not vary along it."""
    axis = geo.out if key == "out" else geo.inn
    if axis.dim is None:
        return None
    size = geo.out_size if key == "out" else geo.in_size
    axis_word = "output" if key == "out" else "input"
    for align in geo.out_align if key == "out" else geo.in_align:
        for start, stop in blocks:
            for b in (start, stop):
                if 0 < b < size and b % align.unit:
                    raise QuantizationSplitError(
                        f"tensor {name!r} ({geo.label}): the {split.value} split of its "
                        f"{axis_word} dim (size {size}) has a boundary at {b}, which cuts "
                        f"{align.what}; boundaries must be multiples of {align.unit}"
                    )
    u = axis.unit
    out: list[tuple[int, int]] = []
    for start, stop in blocks:
        if start % u or (stop % u and not (axis.ceil and stop == size)):
            raise QuantizationSplitError(
                f"tensor {name!r} ({geo.label}): block [{start}, {stop}) of its {axis_word} dim "
                f"does not fall on whole units of {u}"
            )
        a, b = start // u, -(-stop // u)
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return axis.dim, out
