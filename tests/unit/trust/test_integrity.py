"""Digests (``weightd.server.trust.integrity``): BLAKE3 of every tensor, SHA-256 anchors per slice.

Anchors are checked against each rank's slice cut by torch from the same tensor, and
refused when the bytes no longer match the verified digest.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from tests.unit.tiny_checkpoint import (
    CONFIG,
    SHARD1,
    T2,
    _b3,
    llama_tensors,
    loaded,
    split_in_two,
    tbytes,
    write_model,
)
from weightd.server.base.errors import DataIntegrityError
from weightd.server.plan.builtin_rules import rules_for
from weightd.server.plan.planner import plan_rank
from weightd.server.store.runs import RunPattern, block_pattern, whole_pattern
from weightd.server.trust import integrity
from weightd.server.trust.integrity import anchor_slices, hash_checkpoint


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("block", [None, 5, 1000])
@pytest.mark.parametrize("threads", [None, 1, 3])
def test_hash_checkpoint_is_blake3_of_each_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int | None, threads: int | None
) -> None:
    tensors = llama_tensors()
    tensors["empty"] = torch.zeros(0, 4)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    shards = split_in_two(tensors)
    root = write_model(tmp_path / "m", shards)
    if block is not None:
        monkeypatch.setattr(integrity, "BLOCK_BYTES", block)
    with loaded(root) as (ckpt, store):
        digests = hash_checkpoint(ckpt, store, threads)
    assert digests == {name: _b3(tbytes(t)) for name, t in tensors.items()}
    assert digests["empty"] == _b3(b"")


def test_hash_checkpoint_of_a_truncated_shard_raises(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    with loaded(root) as (ckpt, store):
        os.truncate(root / SHARD1, 100)
        with pytest.raises(DataIntegrityError, match=SHARD1):
            hash_checkpoint(ckpt, store)


def expected_rank_bytes(t: torch.Tensor, split: str, ws: int, rank: int, kv: int = 2) -> bytes:
    if split == "replicated":
        return tbytes(t)
    if split == "kv" and ws > kv:
        hd = t.shape[0] // kv
        return tbytes(t[(rank // (ws // kv)) * hd :][:hd])
    dim = 1 if split == "row" else 0
    n = t.shape[dim] // ws
    return tbytes(t.narrow(dim, rank * n, n))


ANCHOR_CASES = [
    ("model.layers.0.self_attn.o_proj.weight", "row"),
    ("model.layers.0.mlp.down_proj.weight", "row"),
    ("model.layers.0.self_attn.q_proj.weight", "column"),
    ("model.layers.0.self_attn.k_proj.weight", "kv"),
    ("model.embed_tokens.weight", "column"),
    ("lm_head.weight", "column"),
    ("model.norm.weight", "replicated"),
]


@pytest.mark.parametrize("block", [None, 7, 100])
@pytest.mark.parametrize("ws", [1, 2, 4])
@pytest.mark.parametrize(("name", "split"), ANCHOR_CASES, ids=[c[0] for c in ANCHOR_CASES])
def test_anchor_slices_are_sha256_of_each_rank_slice(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    split: str,
    ws: int,
    block: int | None,
) -> None:
    tensors = llama_tensors()
    root = write_model(tmp_path / "m", split_in_two(tensors))
    if block is not None:
        monkeypatch.setattr(integrity, "BLOCK_BYTES", block)
    rules = rules_for(CONFIG)
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[name]
        patterns = [plan_rank(ckpt, rules, ws, r, (name,)).slices[0].pattern for r in range(ws)]
        if split == "row" and ws > 1:
            assert all(p.count > 1 for p in patterns)  # the row-pattern branch
        else:
            assert all(p.count == 1 for p in patterns)
        got = anchor_slices(store, t, _b3(tbytes(tensors[name])), patterns)
    want_split = "replicated" if ws == 1 else split
    assert got == [_sha(expected_rank_bytes(tensors[name], want_split, ws, r)) for r in range(ws)]


def test_anchor_slices_mixed_patterns_and_fused_blocks(tmp_path: Path) -> None:
    tensors = llama_tensors()
    root = write_model(tmp_path / "m", split_in_two(tensors))
    name = "model.layers.0.mlp.gate_proj.weight"  # BF16 [32, 16]
    src = tensors[name]
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[name]
        patterns = [
            whole_pattern(t.offset, t.nbytes),
            block_pattern(t.offset, t.shape, 16, 0, [(0, 4), (16, 20)]),
            block_pattern(t.offset, t.shape, 16, 0, [(31, 32)]),
        ]
        got = anchor_slices(store, t, _b3(tbytes(src)), patterns)
    assert got == [
        _sha(tbytes(src)),
        _sha(tbytes(torch.cat([src[0:4], src[16:20]]))),
        _sha(tbytes(src[31:32])),
    ]


@pytest.mark.parametrize("name", [T2, "model.layers.0.self_attn.o_proj.weight"])
def test_anchor_slices_refuse_bytes_that_no_longer_match(tmp_path: Path, name: str) -> None:
    """The file changed between verification and the first fetch of a tensor."""
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    with loaded(root) as (ckpt, store):
        verified = hash_checkpoint(ckpt, store)
    t = ckpt.tensors[name]
    with open(root / t.shard, "r+b") as f:
        f.seek(t.offset + 3)
        byte = f.read(1)[0]
        f.seek(t.offset + 3)
        f.write(bytes([byte ^ 0x5A]))
    rules = rules_for(CONFIG)
    with loaded(root) as (ckpt2, store2):
        t2 = ckpt2.tensors[name]
        assert t2 == t
        patterns = [plan_rank(ckpt2, rules, 2, r, (name,)).slices[0].pattern for r in range(2)]
        with pytest.raises(DataIntegrityError) as info:
            anchor_slices(store2, t2, verified[name], patterns)
    msg = str(info.value)
    assert repr(name) in msg
    assert t.shard in msg
    assert verified[name] in msg


def test_anchor_slices_with_a_wrong_digest(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors["model.norm.weight"]
        with pytest.raises(DataIntegrityError, match="verified digest is blake3:00"):
            anchor_slices(store, t, "blake3:" + "00" * 32, [whole_pattern(t.offset, t.nbytes)])


def test_anchor_slices_reject_inconsistent_row_patterns(tmp_path: Path) -> None:
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors["model.layers.0.self_attn.o_proj.weight"]  # BF16 [16, 16]
        digest = hash_checkpoint(ckpt, store)[t.name]
        p0 = block_pattern(t.offset, t.shape, 16, 1, [(0, 8)])
        # A peer with a different row stride cannot be a cut of the same grid of rows.
        other_stride = RunPattern(t.offset, p0.stride // 2, p0.count * 2, ((0, 8),))
        with pytest.raises(DataIntegrityError, match="disagree on row layout"):
            anchor_slices(store, t, digest, [p0, other_stride])
        # Rows may start later (stacked experts), but never off a row boundary or past
        # the end of the tensor.
        off_row = RunPattern(t.offset + 2, p0.stride, p0.count - 1, p0.segments)
        with pytest.raises(DataIntegrityError, match="disagree on row layout"):
            anchor_slices(store, t, digest, [off_row])
        past_end = RunPattern(t.offset + p0.stride, p0.stride, p0.count, p0.segments)
        with pytest.raises(DataIntegrityError, match="disagree on row layout"):
            anchor_slices(store, t, digest, [past_end])


def test_slice_anchors_keep_a_bounded_number_of_cuts(tmp_path: Path) -> None:
    """Client-chosen layouts cannot grow the cache without end (least recent out first);
    an evicted cut is anchored again, from the bytes, when asked for."""
    tensors = llama_tensors()
    root = write_model(tmp_path / "m", split_in_two(tensors))
    name = "model.layers.0.mlp.gate_proj.weight"
    rules = rules_for(CONFIG)
    with loaded(root) as (ckpt, store):
        t = ckpt.tensors[name]
        anchors = integrity.SliceAnchors(store, {name: _b3(tbytes(tensors[name]))}, max_entries=2)
        asked: list[int] = []

        def peers(ws: int) -> list[RunPattern]:
            asked.append(ws)
            return [plan_rank(ckpt, rules, ws, r, (name,)).slices[0].pattern for r in range(ws)]

        def digest(ws: int) -> str:
            return anchors.get(t, ("tp", ws), 0, lambda: peers(ws))

        first = {ws: digest(ws) for ws in (1, 2, 4)}  # three cuts, room for two
        assert len(anchors) == 2 and asked == [1, 2, 4]
        assert digest(4) == first[4] and asked == [1, 2, 4]  # kept: no new anchoring
        assert digest(1) == first[1] and asked == [1, 2, 4, 1]  # evicted: anchored again
        assert len(anchors) == 2
    assert first[1] == _sha(tbytes(tensors[name]))
