"""Tensor-parallel cuts of one tensor: logical blocks of its module, mapped onto its dims. Pure.

A split (``rules.Split``) names, for a rank, blocks of the module's logical output
or input dim: equal blocks, whole query heads, whole kv heads (replicated past the
kv-head count), or one block per part of a fused tensor (Phi-3 ``qkv_proj`` gets
its q, k and v heads; ``gate_up_proj`` each half). :func:`physical` maps those
blocks onto the tensor through its ``quant.Geometry``, refusing any boundary that
would cut a packed word, a quantization group or a scale block.

Vocabulary-parallel tensors are cut in equal blocks, or, when the layout names a
``vocab_pad``, as vLLM's ``VocabParallelEmbedding`` cuts them
(:func:`padded_vocab_rows`): uneven shares, possibly empty ones for the last ranks.
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


def padded_vocab_rows(vocab: int, tp: int, rank: int, pad: int) -> tuple[int, int]:
    """vLLM's ``[start, stop)`` of checkpoint rows for ``rank`` of a vocabulary padded to ``pad``.

    ``VocabParallelEmbedding._get_indices`` for the original vocabulary (no LoRA extra
    rows): ``padded = ceil(vocab / pad) * pad``, ``per = padded / tp``, and rank ``r``
    holds ``[min(r * per, vocab), min((r + 1) * per, vocab))``; the rows past ``vocab``
    are vLLM's zero padding, never served. Raises ValueError when ``padded`` is not
    divisible by ``tp`` (vLLM's own ``divide`` asserts on it too).
    """
    if vocab < 0 or tp < 1 or not 0 <= rank < tp or pad < 1:
        raise ValueError(f"no vocabulary cut for vocab={vocab} tp={tp} rank={rank} pad={pad}")
    padded = -(-vocab // pad) * pad
    if padded % tp:
        raise ValueError(
            f"padded to a multiple of vocab_pad {pad} it has {padded} rows, which is not "
            f"divisible by tensor-parallel world_size {tp}"
        )
    per = padded // tp
    return min(rank * per, vocab), min((rank + 1) * per, vocab)


def uneven_vocab(split: Split, size: int, pad: int) -> bool:
    """Whether a ``vocab_pad`` cut of a dim of ``size`` differs from equal blocks.

    It does exactly when padding adds rows: with ``size % pad == 0``, ``per`` is
    ``size / tp``. The planner keys slice digests by it, so a ``vocab_pad`` layout of a
    vocabulary that needs no padding shares every anchor with ``vocab_pad`` 0.
    """
    return split is Split.VOCAB and pad > 0 and size % pad != 0


def _vocab(where: str, size: int, tp: int, rank: int, pad: int) -> list[tuple[int, int]]:
    if not pad:
        return _even(where, size, tp, rank)
    try:
        return [padded_vocab_rows(size, tp, rank, pad)]
    except ValueError as exc:
        raise ShardingError(f"{where} of size {size}: {exc}") from None


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
    vocab_pad: int = 0,
) -> tuple[str, list[tuple[int, int]]]:
    """Which logical axis (``"out"``/``"in"``) the split cuts, and this rank's blocks of it.

    ``vocab_pad`` (the layout's) applies to ``Split.VOCAB`` only.
    """
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
    if split is Split.VOCAB:
        return key, _vocab(where, size, tp, rank, vocab_pad)
    if split in (Split.COLUMN, Split.ROW):
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
        if start == stop:
            # An empty share (the last ranks of vLLM's padded vocabulary): no unit is
            # cut, and it is empty in every tensor of the module (a ceil-sized scale
            # tensor included), placed where the dim ends.
            a = b = -(-start // u)
        elif start % u or (stop % u and not (axis.ceil and stop == size)):
            raise QuantizationSplitError(
                f"tensor {name!r} ({geo.label}): block [{start}, {stop}) of its {axis_word} dim "
                f"does not fall on whole units of {u}"
            )
        else:
            a, b = start // u, -(-stop // u)
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return axis.dim, out
