"""Rank-pack layout: a pure function, checked against a table of cases."""

from __future__ import annotations

import pytest

from weightd.server.packs.build import PACK_ALIGN, layout_pack
from weightd.server.plan.slices import TensorSlice
from weightd.server.store.runs import whole_pattern


def _slice(nbytes: int) -> TensorSlice:
    return TensorSlice("t", "U8", (nbytes,), (nbytes,), "s", 0, True, whole_pattern(0, nbytes))


@pytest.mark.parametrize(
    ("sizes", "align", "offsets", "size"),
    [
        ([], 256, [], 256),  # an empty pack can still be mapped
        ([0], 256, [0], 256),
        ([1], 256, [0], 256),
        ([256, 1], 256, [0, 256], 512),
        ([1, 1, 1], 256, [0, 256, 512], 768),
        ([300, 0, 5], 256, [0, 512, 512], 768),  # empty tensors take no room
        ([4096, 10], 4096, [0, 4096], 8192),
        ([10, 10], 1, [0, 10], 20),
    ],
)
def test_layout(sizes: list[int], align: int, offsets: list[int], size: int) -> None:
    got_offsets, got_size = layout_pack([_slice(n) for n in sizes], align)
    assert (got_offsets, got_size) == (offsets, size)


def test_default_alignment_and_no_overlap() -> None:
    sizes = [7, 1000, 256, 3, 65536, 1]
    offsets, size = layout_pack([_slice(n) for n in sizes])
    assert all(o % PACK_ALIGN == 0 for o in offsets)
    ends = [o + n for o, n in zip(offsets, sizes, strict=True)]
    assert all(e <= o for e, o in zip(ends, offsets[1:], strict=False))
    assert ends[-1] <= size and size % PACK_ALIGN == 0


@pytest.mark.parametrize("align", [0, -256, 3, 100])
def test_alignment_must_be_a_power_of_two(align: int) -> None:
    with pytest.raises(ValueError, match="power of two"):
        layout_pack([_slice(1)], align)
