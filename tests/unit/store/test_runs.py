"""Byte-run patterns against numpy slicing of the same row-major bytes."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightd.server.store.runs import RunPattern, block_pattern, whole_pattern

ITEMSIZES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def layout(a: np.ndarray, base: int) -> bytes:
    """A fake file: ``base`` bytes of filler, the array's bytes, then more filler."""
    return bytes(range(256))[:base].ljust(base, b"\xee") + a.tobytes() + b"\xfe" * 13


def gather(buf: bytes, pattern: RunPattern) -> bytes:
    return b"".join(buf[off : off + n] for off, n in pattern.ranges())


def expected(a: np.ndarray, dim: int, blocks: list[tuple[int, int]]) -> bytes:
    if not blocks:
        return b""
    parts = [a.take(range(s, e), axis=dim) for s, e in blocks]
    return np.concatenate(parts, axis=dim).tobytes()


def check(a: np.ndarray, base: int, dim: int, blocks: list[tuple[int, int]]) -> RunPattern:
    buf = layout(a, base)
    pattern = block_pattern(base, a.shape, a.itemsize * 8, dim, blocks)
    want = expected(a, dim, blocks)
    assert gather(buf, pattern) == want
    assert pattern.nbytes == len(want)
    assert sum(n for _, n in pattern.ranges()) == pattern.nbytes
    # runs stay inside the tensor, in ascending file order, never overlapping
    end = base
    for off, n in pattern.ranges():
        assert n > 0
        assert off >= end
        end = off + n
    assert end <= base + a.nbytes
    # segments are ascending and disjoint within a row, and never past the stride
    cursor = 0
    for off, n in pattern.segments:
        assert off >= cursor
        cursor = off + n
    if pattern.count > 1:
        assert cursor <= pattern.stride
    return pattern


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, int, int, list[tuple[int, int]]]:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    itemsize = draw(st.sampled_from(sorted(ITEMSIZES)))
    dim = draw(st.integers(0, ndim - 1))
    size = shape[dim]
    points = sorted(draw(st.lists(st.integers(0, size), max_size=6)))
    if len(points) % 2:
        points = points[:-1]
    blocks = list(zip(points[::2], points[1::2], strict=True))
    base = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**32 - 1))
    # random bytes, so a misplaced or reordered run shows up
    raw = np.random.default_rng(seed).bytes(math.prod(shape) * itemsize)
    a = np.frombuffer(raw, dtype=ITEMSIZES[itemsize]).reshape(shape)
    return a, base, dim, blocks


@settings(max_examples=200, deadline=None)
@given(cases())
def test_pattern_bytes_equal_numpy_concatenation(
    case: tuple[np.ndarray, int, int, list[tuple[int, int]]],
) -> None:
    a, base, dim, blocks = case
    pattern = check(a, base, dim, blocks)
    outer = math.prod(a.shape[:dim])
    covered = a.shape[dim] > 0 and sum(e - s for s, e in blocks) == a.shape[dim]
    if covered and outer > 1:
        assert pattern.count == 1
        assert pattern.segments == ((0, a.nbytes),)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=2, max_size=4),
    st.integers(0, 3),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 4),
)
def test_full_rows_collapse_to_one_run(
    shape: list[int], dim_pick: int, itemsize: int, pieces: int
) -> None:
    dim = dim_pick % len(shape)
    size = shape[dim]
    cuts = sorted({0, size, *[min(size, i * size // pieces) for i in range(pieces)]})
    blocks = list(itertools.pairwise(cuts))
    a = np.arange(math.prod(shape), dtype=ITEMSIZES[itemsize]).reshape(shape)
    pattern = check(a, 8, dim, blocks)
    assert pattern.count == 1
    assert list(pattern.ranges()) == [(8, a.nbytes)]


EXPLICIT = [
    # shape, itemsize, dim, blocks, (stride, count, segments) with base 0
    pytest.param((4, 6), 2, 1, [(0, 3)], (12, 4, ((0, 6),)), id="row-parallel-first-half"),
    pytest.param((4, 6), 2, 1, [(3, 6)], (12, 4, ((6, 6),)), id="row-parallel-second-half"),
    pytest.param((8, 4), 4, 0, [(2, 4)], (128, 1, ((32, 32),)), id="column-parallel"),
    pytest.param(
        (12, 4), 1, 0, [(0, 2), (4, 6), (8, 10)], (48, 1, ((0, 8), (16, 8), (32, 8))), id="fused"
    ),
    pytest.param((3, 4), 1, 0, [(0, 1), (1, 3)], (12, 1, ((0, 12),)), id="adjacent-merge"),
    pytest.param((2, 3, 4), 1, 1, [(1, 2)], (12, 2, ((4, 4),)), id="middle-dim"),
    pytest.param((2, 3, 4), 1, 2, [(0, 4)], (24, 1, ((0, 24),)), id="last-dim-whole"),
    pytest.param((2, 3, 4), 1, 2, [(1, 2)], (4, 6, ((1, 1),)), id="last-dim-one"),
    pytest.param((5,), 8, 0, [(1, 4)], (40, 1, ((8, 24),)), id="1d"),
    pytest.param((4, 6), 2, 1, [], (12, 4, ()), id="no-blocks"),
    pytest.param((4, 6), 2, 1, [(2, 2)], (12, 4, ((4, 0),)), id="empty-block"),
]


@pytest.mark.parametrize(("shape", "itemsize", "dim", "blocks", "want"), EXPLICIT)
def test_explicit_patterns(
    shape: tuple[int, ...],
    itemsize: int,
    dim: int,
    blocks: list[tuple[int, int]],
    want: tuple[int, int, tuple[tuple[int, int], ...]],
) -> None:
    a = np.arange(1, math.prod(shape) + 1, dtype=ITEMSIZES[itemsize]).reshape(shape)
    pattern = check(a, 0, dim, blocks)
    assert (pattern.stride, pattern.count, pattern.segments) == want
    assert pattern.base == 0


def test_base_offsets_every_run() -> None:
    a = np.arange(24, dtype=np.uint8).reshape(4, 6)
    p0 = block_pattern(0, a.shape, 8, 1, [(2, 4)])
    p9 = block_pattern(1000, a.shape, 8, 1, [(2, 4)])
    assert [(o + 1000, n) for o, n in p0.ranges()] == list(p9.ranges())


def test_row_bytes_and_nbytes() -> None:
    p = RunPattern(base=10, stride=100, count=3, segments=((0, 5), (50, 7)))
    assert p.row_bytes == 12
    assert p.nbytes == 36
    assert list(p.ranges()) == [(10, 5), (60, 7), (110, 5), (160, 7), (210, 5), (260, 7)]


def test_whole_pattern() -> None:
    p = whole_pattern(64, 100)
    assert p == RunPattern(64, 100, 1, ((0, 100),))
    assert list(p.ranges()) == [(64, 100)]
    assert p.nbytes == 100
    assert list(whole_pattern(5, 0).ranges()) == []
    assert whole_pattern(5, 0).nbytes == 0


def test_sub_byte_split_on_whole_bytes() -> None:
    # F4 [2, 4]: each row of 4 nibbles is 2 bytes; row 1 is bytes 2..4
    p = block_pattern(100, (2, 4), 4, 0, [(1, 2)])
    assert list(p.ranges()) == [(102, 2)]


INVALID = [
    pytest.param((4, 6), 8, 2, [(0, 1)], id="dim-past-end"),
    pytest.param((4, 6), 8, -1, [(0, 1)], id="negative-dim"),
    pytest.param((), 8, 0, [], id="scalar-has-no-dim"),
    pytest.param((4, 6), 8, 1, [(3, 2)], id="stop-before-start"),
    pytest.param((4, 6), 8, 1, [(0, 7)], id="stop-past-size"),
    pytest.param((4, 6), 8, 1, [(-1, 2)], id="negative-start"),
    pytest.param((4, 6), 8, 1, [(2, 4), (0, 1)], id="descending"),
    pytest.param((4, 6), 8, 1, [(0, 3), (2, 5)], id="overlapping"),
    pytest.param((4, 3), 4, 0, [(0, 1)], id="sub-byte-rows"),  # 1 row of 3 F4 = 12 bits
    pytest.param((3, 3), 4, 1, [(0, 2)], id="sub-byte-row-stride"),  # rows of 12 bits
    pytest.param((4, 3), 4, 1, [(0, 2)], id="sub-byte-elements"),
]


@pytest.mark.parametrize(("shape", "bits", "dim", "blocks"), INVALID)
def test_invalid_blocks_raise_value_error(
    shape: tuple[int, ...], bits: int, dim: int, blocks: list[tuple[int, int]]
) -> None:
    with pytest.raises(ValueError, match=r"dim|blocks|byte"):
        block_pattern(0, shape, bits, dim, blocks)
