"""Reading byte-run patterns through the shard store (``weightd.server.store.shards``).

Every pattern is checked against numpy slicing of the same bytes, for many piece
sizes; small gaps are read through scratch in one ``preadv``, large ones separately.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from weightd.server.store.runs import block_pattern, whole_pattern
from weightd.server.store.shards import MAX_GAP_BYTES, ShardStore, pattern_pieces


@pytest.fixture
def raw_file(tmp_path: Path) -> Iterator[Callable[[int], tuple[ShardStore, bytes]]]:
    stores: list[ShardStore] = []

    def make(size: int) -> tuple[ShardStore, bytes]:
        data = np.random.default_rng(size).bytes(size)
        (tmp_path / "data.bin").write_bytes(data)
        store = ShardStore(str(tmp_path))
        store.open("data.bin")
        stores.append(store)
        return store, data

    yield make
    for s in stores:
        s.close()


BASE = 4096 + 7  # an odd offset, so nothing lines up by accident
PATTERN_CASES = [
    # rows, cols, dim, blocks
    pytest.param(64, 1024, 1, [(256, 512)], id="small-gap"),
    pytest.param(6, MAX_GAP_BYTES + 100, 1, [(0, 100)], id="gap-at-limit"),
    pytest.param(6, MAX_GAP_BYTES + 101, 1, [(0, 100)], id="gap-over-limit"),
    pytest.param(5, 300_000, 1, [(1000, 3000)], id="large-gap"),
    pytest.param(32, 512, 1, [(0, 16), (100, 116), (500, 512)], id="three-segments"),
    pytest.param(3000, 8, 1, [(2, 4)], id="many-rows"),
    pytest.param(64, 64, 0, [(16, 32)], id="column"),
    pytest.param(64, 64, 1, [(0, 64)], id="all-rows-whole"),
]
MAX_BYTES = [1, 3, 64, 1000, 4096, 1 << 20]


def numpy_slice(a: np.ndarray, dim: int, blocks: list[tuple[int, int]]) -> bytes:
    return np.concatenate([a.take(range(s, e), axis=dim) for s, e in blocks], axis=dim).tobytes()


@pytest.mark.parametrize("max_bytes", MAX_BYTES)
@pytest.mark.parametrize(("rows", "cols", "dim", "blocks"), PATTERN_CASES)
def test_iter_pattern_equals_numpy_slicing(
    raw_file: Callable[[int], tuple[ShardStore, bytes]],
    rows: int,
    cols: int,
    dim: int,
    blocks: list[tuple[int, int]],
    max_bytes: int,
) -> None:
    store, data = raw_file(BASE + rows * cols + 50)
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    pattern = block_pattern(BASE, a.shape, 8, dim, blocks)
    pieces = list(store.iter_pattern("data.bin", pattern, max_bytes))
    assert b"".join(pieces) == numpy_slice(a, dim, blocks)
    assert all(0 < len(p) <= max_bytes for p in pieces)


@pytest.mark.parametrize("max_bytes", MAX_BYTES)
@pytest.mark.parametrize(("rows", "cols", "dim", "blocks"), PATTERN_CASES)
def test_pieces_read_in_place_are_iter_patterns_pieces(
    raw_file: Callable[[int], tuple[ShardStore, bytes]],
    rows: int,
    cols: int,
    dim: int,
    blocks: list[tuple[int, int]],
    max_bytes: int,
) -> None:
    """The Fetch stream reads each piece into its message: the same cuts, the same bytes."""
    store, data = raw_file(BASE + rows * cols + 50)
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    pattern = block_pattern(BASE, a.shape, 8, dim, blocks)
    pieces = list(pattern_pieces(pattern, max_bytes))
    filled = []
    for piece in pieces:
        dst = bytearray(b"\xa5" * piece.size)  # no byte may be left as it was by chance
        store.read_piece_into("data.bin", pattern, piece, memoryview(dst))
        filled.append(bytes(dst))
    assert filled == [bytes(p) for p in store.iter_pattern("data.bin", pattern, max_bytes)]
    assert b"".join(filled) == numpy_slice(a, dim, blocks)
    with pytest.raises(ValueError, match="destination holds"):
        store.read_piece_into("data.bin", pattern, pieces[0], memoryview(bytearray(1 + max_bytes)))


@pytest.mark.parametrize("max_bytes", [2, 1000, 1 << 20])
def test_iter_pattern_multi_byte_elements(
    raw_file: Callable[[int], tuple[ShardStore, bytes]], max_bytes: int
) -> None:
    store, data = raw_file(BASE + 48 * 40 * 2 + 10)
    a = np.frombuffer(data, np.uint16, 48 * 40, BASE).reshape(48, 40)
    for rank in range(4):
        pattern = block_pattern(BASE, a.shape, 16, 1, [(rank * 10, rank * 10 + 10)])
        got = b"".join(store.iter_pattern("data.bin", pattern, max_bytes))
        assert got == a[:, rank * 10 : rank * 10 + 10].tobytes()


class PreadvSpy:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (number of buffers, offset)
        self.real = os.preadv

    def __call__(self, fd: int, buffers: list[Any], offset: int, *rest: Any) -> int:
        self.calls.append((len(buffers), offset))
        return self.real(fd, buffers, offset, *rest)


@pytest.fixture
def preadv_spy(monkeypatch: pytest.MonkeyPatch) -> PreadvSpy:
    spy = PreadvSpy()
    monkeypatch.setattr(os, "preadv", spy)
    return spy


def test_small_gaps_are_read_through_scratch_in_one_call(
    raw_file: Callable[[int], tuple[ShardStore, bytes]], preadv_spy: PreadvSpy
) -> None:
    rows, cols, gap = 6, MAX_GAP_BYTES + 100, MAX_GAP_BYTES
    store, data = raw_file(BASE + rows * cols)
    pattern = block_pattern(BASE, (rows, cols), 8, 1, [(0, 100)])
    (piece,) = list(store.iter_pattern("data.bin", pattern, 1 << 20))
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    assert piece == a[:, :100].tobytes()
    assert cols - 100 == gap
    # one preadv: 6 wanted runs and the 5 gaps between them
    assert preadv_spy.calls == [(2 * rows - 1, BASE)]


def test_large_gaps_are_separate_reads(
    raw_file: Callable[[int], tuple[ShardStore, bytes]], preadv_spy: PreadvSpy
) -> None:
    rows, cols = 6, MAX_GAP_BYTES + 101
    store, data = raw_file(BASE + rows * cols)
    pattern = block_pattern(BASE, (rows, cols), 8, 1, [(0, 100)])
    (piece,) = list(store.iter_pattern("data.bin", pattern, 1 << 20))
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    assert piece == a[:, :100].tobytes()
    assert preadv_spy.calls == [(1, BASE + i * cols) for i in range(rows)]


def test_many_rows_split_preadv_at_the_iov_limit(
    raw_file: Callable[[int], tuple[ShardStore, bytes]], preadv_spy: PreadvSpy
) -> None:
    rows, cols = 3000, 8
    store, data = raw_file(BASE + rows * cols)
    pattern = block_pattern(BASE, (rows, cols), 8, 1, [(2, 4)])
    (piece,) = list(store.iter_pattern("data.bin", pattern, 1 << 20))
    a = np.frombuffer(data, np.uint8, rows * cols, BASE).reshape(rows, cols)
    assert piece == a[:, 2:4].tobytes()
    assert len(preadv_spy.calls) > 1
    assert all(n <= 1024 for n, _ in preadv_spy.calls)


def test_iter_pattern_of_count_one_is_chunked(
    raw_file: Callable[[int], tuple[ShardStore, bytes]],
) -> None:
    store, data = raw_file(10_000)
    pieces = list(store.iter_pattern("data.bin", whole_pattern(100, 9_000), 4096))
    assert [len(p) for p in pieces] == [4096, 4096, 808]
    assert b"".join(pieces) == data[100:9_100]
