"""A rank's view of a model version: its slices as pieces that read and check themselves.

What a gRPC ``Fetch`` streams, without the wire: the edge (``rpc/weights.py``) decides
how many pieces fit a message and encodes them; here each piece is read from its shard
straight into the buffer the edge hands it, feeds the slice's running hash when asked
to re-hash, and on the slice's last piece is compared with the verified (anchored)
digest, so bytes that no longer match raise before the edge can send them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from weightd.common.digests import Hasher, slice_digest

from ..base.errors import DataIntegrityError
from ..plan.planner import RankPlan
from ..plan.slices import TensorSlice
from ..registry.models import LoadedModel
from ..store.shards import Piece, pattern_pieces
from ..trust.integrity import slice_hasher

#: Writes one piece into the buffer it is given (exactly the piece's size).
Fill = Callable[[memoryview], None]


@dataclass(frozen=True, slots=True)
class SlicePiece:
    """One piece of slice ``index``: ``size`` bytes at ``offset`` within the slice."""

    index: int
    slice: TensorSlice
    offset: int
    size: int
    fill: Fill
    #: The slice's anchored digest on its last piece; "" on the others.
    digest: str
    #: The slice's first piece (the one whose message carries the slice's header).
    first: bool


@dataclass(frozen=True, slots=True)
class RankView:
    """``model``'s slices for one rank (``plan``), in the order they are sent."""

    model: LoadedModel
    plan: RankPlan

    def pieces(
        self,
        chunk: int,
        start: int = 0,
        kind: str = "sha256",
        rehash: bool = False,
        *,
        alive: Callable[[], bool] = lambda: True,
    ) -> Iterator[SlicePiece]:
        """The pieces of slices ``start`` onwards, ``chunk`` bytes at most each.

        ``rehash``: hash each slice's bytes (``kind``) as they are read and compare with
        the verified digest before its last piece is handed out; without it the anchored
        digest is handed out as it is (the store still checks each shard's identity after
        every read, and the client checks every byte against the digest). ``alive``
        is asked before each slice: once it says no (the reader went away), no more.
        """
        for index, s in enumerate(self.plan.slices):
            if index < start:
                continue  # a resume: the client holds these already
            if not alive():
                return
            anchored = self.model.slice_anchor(s, self.plan.layout, kind)
            hasher = slice_hasher(kind) if rehash else None
            offset = 0
            pieces: Iterator[Piece] | tuple[Piece, ...] = pattern_pieces(s.pattern, chunk)
            if s.nbytes == 0:
                pieces = (Piece(0),)
            for piece in pieces:
                last = offset + piece.size == s.nbytes
                fill = _filler(self.model, s, piece, hasher, kind, anchored if last else None)
                digest = anchored if last else ""
                yield SlicePiece(index, s, offset, piece.size, fill, digest, offset == 0)
                offset += piece.size


def _filler(
    model: LoadedModel,
    s: TensorSlice,
    piece: Piece,
    hasher: Hasher | None,
    kind: str,
    anchored: str | None,
) -> Fill:
    """What writes one piece of slice ``s`` into its buffer (see :meth:`RankView.pieces`).

    It reads the piece from the shard straight into the buffer (the store checks the
    shard's identity after the read), feeds the slice's running hash, and on the
    slice's last piece (``anchored`` set) compares the digest with the verified one:
    a mismatch raises before the buffer is handed on, so those bytes are never sent.
    """

    def fill(view: memoryview) -> None:
        if view.nbytes:
            model.store.read_piece_into(s.shard, s.pattern, piece, view)
        if hasher is not None:
            hasher.update(view)
        if anchored is None:
            return
        actual = anchored if hasher is None else slice_digest(hasher, kind)
        if actual != anchored:
            raise DataIntegrityError(
                f"tensor {s.name!r} in shard {s.shard}: slice bytes read now hash to "
                f"{actual}, the verified slice to {anchored}"
            )

    return fill
