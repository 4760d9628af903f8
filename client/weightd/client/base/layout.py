"""The client's parallel layout: what a worker tells the daemon about where it sits.

Mirrors the ``weightd.v1.Layout`` message. ``Layout(tp_size=4, tp_rank=1)`` is what
``fetch(rank=1, world_size=4)`` sends; pipeline and expert parallel workers add
``pp_size``/``pp_rank`` and ``ep_size``/``ep_rank``. ``vocab_pad=N`` asks for
vocabulary-parallel tensors cut as vLLM cuts a vocabulary padded to a multiple of
``N`` (uneven rows, possibly none) instead of equal blocks. The daemon checks the
layout against the model; the client only refuses what the wire cannot carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgumentError

if TYPE_CHECKING:
    from weightd.v1 import weightd_pb2 as pb

_UINT32 = 1 << 32


@dataclass(frozen=True)
class Layout:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    #: Decoder layers per pipeline stage, in stage order; empty: the daemon's default
    #: even split (vLLM's). Must sum to the model's ``num_hidden_layers``.
    pp_layers: tuple[int, ...] = ()
    #: 0: vocabulary-parallel tensors in equal blocks. N > 0: cut as vLLM cuts a
    #: vocabulary padded to a multiple of N (``padding_size``; vLLM's default is 64):
    #: rank r gets rows ``[min(r * per, vocab), min((r + 1) * per, vocab))``,
    #: ``per = padded / tp_size``. The daemon bounds it (65536).
    vocab_pad: int = 0

    def check(self) -> None:
        """Refuse values a uint32 cannot carry or a rank outside its size."""
        for size_name, rank_name in (
            ("tp_size", "tp_rank"),
            ("pp_size", "pp_rank"),
            ("ep_size", "ep_rank"),
        ):
            size, rank = getattr(self, size_name), getattr(self, rank_name)
            if not 1 <= size < _UINT32 or not 0 <= rank < size:
                raise InvalidArgumentError(
                    f"{rank_name} {rank} / {size_name} {size} is invalid: need "
                    f"0 <= {rank_name} < {size_name}"
                )
        if any(not 0 <= n < _UINT32 for n in self.pp_layers):
            raise InvalidArgumentError(f"pp_layers {list(self.pp_layers)} has an invalid count")
        if not 0 <= self.vocab_pad < _UINT32:
            raise InvalidArgumentError(
                f"vocab_pad {self.vocab_pad} is invalid: need 0 <= vocab_pad < 2**32"
            )

    @classmethod
    def of_proto(cls, msg: pb.Layout | Any) -> Layout:
        """The layout a message names; pipeline/expert sizes of 0 (older peers) are 1."""
        return cls(
            tp_size=msg.tp_size,
            tp_rank=msg.tp_rank,
            pp_size=msg.pp_size or 1,
            pp_rank=msg.pp_rank,
            ep_size=msg.ep_size or 1,
            ep_rank=msg.ep_rank,
            pp_layers=tuple(msg.pp_layers),
            vocab_pad=msg.vocab_pad,
        )

    def describe(self) -> str:
        """``tp 1/2`` (and ``pp 0/2``, ``ep 1/4`` when set), as in the daemon's messages."""
        parts = [f"tp {self.tp_rank}/{self.tp_size}"]
        if self.pp_size > 1:
            parts.append(f"pp {self.pp_rank}/{self.pp_size}")
        if self.ep_size > 1:
            parts.append(f"ep {self.ep_rank}/{self.ep_size}")
        if self.vocab_pad:
            parts.append(f"vocab_pad {self.vocab_pad}")
        return ", ".join(parts)

    def to_proto(self) -> pb.Layout:
        """The layout as the wire message ``weightd.v1.Layout``."""
        from weightd.v1 import weightd_pb2 as pb

        return pb.Layout(
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            pp_size=self.pp_size,
            pp_rank=self.pp_rank,
            ep_size=self.ep_size,
            ep_rank=self.ep_rank,
            pp_layers=list(self.pp_layers),
            vocab_pad=self.vocab_pad,
        )
