"""Shard files changing under the shard store: truncated, rewritten in place, replaced.

A changed file is refused with ``DataIntegrityError`` naming it, before any byte is
handed out; a file replaced by rename keeps serving the bytes that were verified.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.tiny_checkpoint import (
    SHARD1,
    SHARD2,
    T2,
    _b3,
    llama_tensors,
    loaded,
    open_fds,
    split_in_two,
    tbytes,
    write_model,
)
from weightd.server.base.errors import DataIntegrityError
from weightd.server.checkpoint.description import TensorInfo
from weightd.server.checkpoint.scan import load_checkpoint
from weightd.server.store.runs import RunPattern, block_pattern, whole_pattern
from weightd.server.store.shards import pattern_pieces
from weightd.server.trust.integrity import hash_checkpoint

# --- ShardStore: files changing under the daemon -----------------------------------------------


def _model_with_old_mtime(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint whose shards' mtimes are in the past.

    File timestamps may be coarse (a clock tick), so a rewrite right after creation can
    leave ctime/mtime unchanged; moving mtime back first makes any later write visible.
    """
    tensors = llama_tensors()
    root = write_model(tmp_path / "m", split_in_two(tensors))
    for shard in (SHARD1, SHARD2):
        os.utime(root / shard, ns=(1_000_000_000, 1_000_000_000))
    return root, tensors


def _row_pattern(t: TensorInfo) -> RunPattern:
    return block_pattern(t.offset, t.shape, 16, 1, [(0, t.shape[1] // 2)])


@pytest.mark.parametrize("kind", ["whole", "rows"])
@pytest.mark.parametrize("cut", ["inside-tensor", "at-tensor-start", "empty-file"])
def test_truncated_shard_raises_data_integrity_error(tmp_path: Path, kind: str, cut: str) -> None:
    root, _ = _model_with_old_mtime(tmp_path)
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[T2]  # BF16 [64, 16] in SHARD2
        sizes = {"inside-tensor": t.offset + t.nbytes // 2, "at-tensor-start": t.offset}
        size = sizes.get(cut, 0)
        os.truncate(root / t.shard, size)
        pattern = whole_pattern(t.offset, t.nbytes) if kind == "whole" else _row_pattern(t)
        got: list[bytes] = []
        with pytest.raises(DataIntegrityError) as info:
            got.extend(store.iter_pattern(t.shard, pattern, 256))
        assert got == []  # no piece is handed out once the file changed
        assert str(root / t.shard) in str(info.value)
        with pytest.raises(DataIntegrityError, match="short read"):
            store.read_exact(t.shard, t.offset, t.nbytes)
        for piece in pattern_pieces(pattern, 256):  # read in place (Fetch): refused as well
            with pytest.raises(DataIntegrityError):
                store.read_piece_into(t.shard, pattern, piece, memoryview(bytearray(piece.size)))
        with pytest.raises(DataIntegrityError, match=f"size changed from .* to {size} bytes"):
            store.check(t.shard)


def test_truncation_after_the_tensor_is_caught_by_the_identity_check(tmp_path: Path) -> None:
    root, tensors = _model_with_old_mtime(tmp_path)
    with loaded(root) as (ckpt, store):
        first = min((t for t in ckpt.tensors.values() if t.shard == SHARD2), key=lambda t: t.offset)
        os.truncate(root / SHARD2, first.offset + first.nbytes)
        # the bytes are still there, but the file is not the one that was verified
        assert store.read_exact(SHARD2, first.offset, first.nbytes) == tbytes(tensors[first.name])
        pattern = whole_pattern(first.offset, first.nbytes)
        with pytest.raises(DataIntegrityError, match="size changed"):
            list(store.iter_pattern(SHARD2, pattern, 1 << 20))
        (piece,) = pattern_pieces(pattern, 1 << 20)
        with pytest.raises(DataIntegrityError, match="size changed"):  # in place, the same
            store.read_piece_into(SHARD2, pattern, piece, memoryview(bytearray(piece.size)))


def test_shard_rewritten_in_place_is_detected(tmp_path: Path) -> None:
    root, tensors = _model_with_old_mtime(tmp_path)
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[T2]
        store.check(t.shard)  # unchanged so far
        size = (root / t.shard).stat().st_size
        with open(root / t.shard, "r+b") as f:
            f.seek(t.offset)
            f.write(bytes(b ^ 0xFF for b in tbytes(tensors[T2])[:32]))
        assert (root / t.shard).stat().st_size == size
        with pytest.raises(DataIntegrityError, match="modified in place") as info:
            store.check(t.shard)
        assert str(root / t.shard) in str(info.value)
        got: list[bytes] = []
        with pytest.raises(DataIntegrityError):
            got.extend(store.iter_pattern(t.shard, whole_pattern(t.offset, t.nbytes), 1 << 20))
        assert got == []
        store.check(SHARD1)  # the other shard is untouched


def test_shard_replaced_by_rename_still_reads_old_bytes(tmp_path: Path) -> None:
    root, tensors = _model_with_old_mtime(tmp_path)
    shards = split_in_two(llama_tensors(seed=99))
    with loaded(root) as (ckpt, store):
        replacement = tmp_path / "new.safetensors"
        save_file(shards[SHARD2], str(replacement))
        os.replace(replacement, root / SHARD2)
        t = ckpt.tensors[T2]
        assert store.read_exact(t.shard, t.offset, t.nbytes) == tbytes(tensors[T2])
        buf = bytearray(t.nbytes)
        store.read_into(t.shard, t.offset, memoryview(buf))
        assert bytes(buf) == tbytes(tensors[T2])
    with loaded(root) as (ckpt2, store2):
        t2 = ckpt2.tensors[T2]
        assert store2.read_exact(t2.shard, t2.offset, t2.nbytes) == tbytes(shards[SHARD2][T2])


def _wait_for_coarse_clock_past(ns: int) -> None:
    """Wait until the kernel's coarse clock (what inode timestamps use) is past ``ns``.

    Then any later inode change gets a later ctime, whatever the timestamp granularity.
    """
    clock = getattr(time, "CLOCK_REALTIME_COARSE", 5)  # 5 on Linux
    while time.clock_gettime_ns(clock) <= ns:
        time.sleep(0.001)


def test_shard_replaced_by_rename_keeps_serving(tmp_path: Path) -> None:
    root, tensors = _model_with_old_mtime(tmp_path)
    shards = split_in_two(llama_tensors(seed=99))
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[T2]
        replacement = tmp_path / "new.safetensors"
        save_file(shards[SHARD2], str(replacement))
        _wait_for_coarse_clock_past(store.shard(t.shard).identity.ctime_ns)
        os.replace(replacement, root / SHARD2)
        store.check(t.shard)
        got = b"".join(store.iter_pattern(t.shard, _row_pattern(t), 100))
        assert got == tbytes(tensors[T2][:, :8])
        digests = hash_checkpoint(ckpt, store)
        assert digests[T2] == _b3(tbytes(tensors[T2]))


def test_close_is_idempotent(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    before = open_fds()
    _, store = load_checkpoint(str(root))
    assert open_fds() == before + 2
    store.close()
    store.close()
    assert open_fds() == before
