"""The work a client can make the daemon do by asking for new cuts is bounded by what it
asks to receive (issue 37, case 11), counted in bytes hashed, never timed.

Each ``(tp_size, vocab_pad)`` pair is a cut of its own. A large tensor is proven once,
whole, into block digests; each new cut then reads and hashes only the blocks its slice
touches. The constants are shrunk so that a tiny checkpoint's 2 KiB vocabulary tensor
is "large" and cut into 256-byte blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.tiny_checkpoint import llama_tensors, split_in_two, write_model
from weightd.server.base.errors import DataIntegrityError
from weightd.server.plan.layout import Layout
from weightd.server.plan.tpcut import padded_vocab_rows
from weightd.server.registry.models import LoadedModel, load_model
from weightd.server.trust import integrity

EMBED = "model.embed_tokens.weight"
BLOCK = 256


def _cuts(n: int) -> list[Layout]:
    """``n`` layouts of tp 2, rank 1, each a distinct cut of the 64-row vocabulary."""
    seen, out = set(), []
    for pad in range(1, 400):
        try:
            rows = padded_vocab_rows(64, 2, 1, pad)
        except ValueError:
            continue
        if rows not in seen and rows[0] < rows[1]:
            seen.add(rows)
            out.append(Layout(tp_size=2, tp_rank=1, vocab_pad=pad))
    assert len(out) >= n, len(out)
    return out[:n]


def _embed_anchor(model: LoadedModel, layout: Layout) -> tuple[str, int]:
    (s,) = model.plan_layout(layout, (EMBED,)).slices
    return model.slice_anchor(s, layout), s.nbytes


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> LoadedModel:
    monkeypatch.setattr(integrity, "WHOLE_ANCHOR_BYTES", 0)
    monkeypatch.setattr(integrity, "ANCHOR_BLOCK_BYTES", BLOCK)
    root = write_model(tmp_path / "m", split_in_two(llama_tensors()))
    return load_model(str(root))


def test_new_cuts_cost_their_slice_not_the_tensor(model: LoadedModel) -> None:
    tensor = model.checkpoint.tensors[EMBED]
    cuts = _cuts(8)
    asked = 0
    for layout in cuts:
        digest, nbytes = _embed_anchor(model, layout)
        asked += nbytes
        (s,) = model.plan_layout(layout, (EMBED,)).slices
        # The same digest the whole-tensor anchoring gives (another code path).
        want = integrity.anchor_slices(
            model.store, tensor, model.tensor_digests[EMBED], [s.pattern]
        )[0]
        assert digest == want
    work = model.anchors.hashed_bytes
    # One proof of the tensor, then each cut: its slice plus at most a block either side.
    assert work <= tensor.nbytes + asked + len(cuts) * 2 * BLOCK, (work, asked)
    # Anchoring every cut whole (as before) cost the whole tensor per cut, whatever the
    # slice: here the cuts past the proof cost what was asked, within a block each side.
    assert work - tensor.nbytes < len(cuts) * tensor.nbytes - asked // 2
    # Asked again, a cut costs nothing more.
    for layout in cuts:
        _embed_anchor(model, layout)
    assert model.anchors.hashed_bytes == work


def test_a_block_changed_on_disk_is_refused(model: LoadedModel) -> None:
    first, second = _cuts(2)
    _embed_anchor(model, first)  # proves the tensor into block digests
    tensor = model.checkpoint.tensors[EMBED]
    path = model.store.shard(tensor.shard).path
    with open(path, "r+b") as f:  # rewritten in place: same size, same inode
        f.seek(tensor.offset + tensor.nbytes - 1)
        old = f.read(1)
        f.seek(tensor.offset + tensor.nbytes - 1)
        f.write(bytes([old[0] ^ 0xFF]))
    with pytest.raises(DataIntegrityError, match=rf"tensor '{EMBED}'.*differ from the verified"):
        _embed_anchor(model, second)
