"""Byte-run patterns: where a slice's bytes lie in a row-major tensor. Pure.

Any slice weightd serves (a block of one dimension, or several blocks of one
dimension concatenated, as fused QKV needs) selects, for each of ``count`` outer
rows spaced ``stride`` bytes apart, the same list of byte segments. A column-parallel
split of dim 0 is one row with one segment; a row-parallel split of ``[out, in]`` is
``out`` rows of one segment each. Keeping the pattern symbolic (instead of listing
4096 runs) keeps plans small and lets the reader batch rows into one ``preadv``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunPattern:
    """Bytes ``base + i*stride + off .. + len`` for i in range(count), per segment, in order."""

    base: int
    stride: int
    count: int
    segments: tuple[tuple[int, int], ...]  # (offset within the row, length), ascending

    @property
    def row_bytes(self) -> int:
        return sum(length for _, length in self.segments)

    @property
    def nbytes(self) -> int:
        return self.count * self.row_bytes

    @property
    def span(self) -> int:
        """Bytes of file from the first byte read to the last (what a rank touches on disk)."""
        used = [(off, length) for off, length in self.segments if length]
        if self.count == 0 or not used:
            return 0
        return (self.count - 1) * self.stride + used[-1][0] + used[-1][1] - used[0][0]

    def ranges(self) -> Iterator[tuple[int, int]]:
        """Every (file offset, length) in output order. For tests and small slices."""
        for i in range(self.count):
            row = self.base + i * self.stride
            for off, length in self.segments:
                if length:
                    yield row + off, length


def block_pattern(
    base: int, shape: Sequence[int], itemsize_bits: int, dim: int, blocks: Sequence[tuple[int, int]]
) -> RunPattern:
    """The pattern of ``cat([t.narrow(dim, a, b - a) for a, b in blocks], dim)``.

    ``t`` has ``shape`` and starts at file offset ``base``. Blocks must be ascending
    and disjoint, and (for sub-byte dtypes) every block must start and end on a whole
    byte; otherwise ValueError, which the planner reports naming the tensor.
    """
    if not 0 <= dim < len(shape):
        raise ValueError(f"dim {dim} out of range for shape {tuple(shape)}")
    outer = math.prod(shape[:dim])
    inner_bits = math.prod(shape[dim + 1 :]) * itemsize_bits
    stride_bits = shape[dim] * inner_bits
    if stride_bits % 8:
        raise ValueError(f"rows of dim {dim} of {tuple(shape)} do not start on whole bytes")
    stride = stride_bits // 8
    segments: list[tuple[int, int]] = []
    cursor = 0
    for start, stop in blocks:
        if not cursor <= start <= stop <= shape[dim]:
            raise ValueError(f"blocks {list(blocks)} are not ascending within 0..{shape[dim]}")
        cursor = stop
        off_bits, len_bits = start * inner_bits, (stop - start) * inner_bits
        if off_bits % 8 or len_bits % 8:
            raise ValueError(
                f"block {start}:{stop} of dim {dim} of {tuple(shape)} cuts through a byte "
                f"({itemsize_bits}-bit elements)"
            )
        off, length = off_bits // 8, len_bits // 8
        if segments and segments[-1][0] + segments[-1][1] == off:
            segments[-1] = (segments[-1][0], segments[-1][1] + length)
        else:
            segments.append((off, length))
    if outer > 1 and segments == [(0, stride)]:
        # Every row taken whole: the slice is one contiguous run.
        return RunPattern(base, stride * outer, 1, ((0, stride * outer),))
    return RunPattern(base, stride, outer, tuple(segments))


def whole_pattern(base: int, nbytes: int) -> RunPattern:
    return RunPattern(base, nbytes, 1, ((0, nbytes),))
