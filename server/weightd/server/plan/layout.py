"""A parallel layout: where one worker sits in (pipeline, expert, tensor) parallelism. Pure.

A worker's coordinates are ``(pp_rank, ep_rank, tp_rank)``. The planner reads them as:

* ``pp``: which contiguous range of decoder layers the worker's stage runs;
* ``tp``: which slice of each tensor-parallel tensor it holds, experts included
  (tensor parallelism inside each expert when ``ep`` and ``tp`` combine);
* ``ep``: which contiguous block of experts it owns. Tensors outside the experts
  (attention, dense MLPs, routers) do not depend on ``ep_rank``.

``vocab_pad`` is not a coordinate but a convention of the engine: how the tp ranks
share a vocabulary-parallel tensor (equal blocks, or vLLM's padded cut).

Global ranks, where one number is needed (``weightd plan``), count ``tp`` fastest,
then ``ep``, then ``pp``, as Megatron orders its groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from ..base.errors import InvalidRequest, ShardingError

#: Largest size accepted for each parallel dimension. Sizes are client-chosen and the
#: daemon enumerates every peer of a slice once to anchor its digest; no deployment
#: comes near this.
MAX_PARALLEL_SIZE: Final = 1024

#: Largest ``vocab_pad`` accepted. vLLM pads to 64 (``DEFAULT_VOCAB_PADDING_SIZE``), or
#: to LoRA's ``lora_vocab_padding_size`` (256); a bound keeps the padded row count a
#: small multiple of any real vocabulary.
MAX_VOCAB_PAD: Final = 1 << 16


class LayoutFields(Protocol):
    """A layout as the wire carries it (``weightd.v1.Layout``): sizes of 0 mean 1."""

    @property
    def tp_size(self) -> int: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def pp_size(self) -> int: ...
    @property
    def pp_rank(self) -> int: ...
    @property
    def ep_size(self) -> int: ...
    @property
    def ep_rank(self) -> int: ...
    @property
    def pp_layers(self) -> Sequence[int]: ...
    @property
    def vocab_pad(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Layout:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    #: Layers per pipeline stage, in stage order; empty means the default even split.
    pp_layers: tuple[int, ...] = ()
    #: How vocabulary-parallel tensors are cut: 0, equal blocks; N > 0, as vLLM cuts a
    #: vocabulary padded to a multiple of N (``tpcut.padded_vocab_rows``).
    vocab_pad: int = 0

    @classmethod
    def tp(cls, world_size: int, rank: int) -> Layout:
        """The tensor-parallel-only layout of the ``fetch(rank, world_size)`` shorthand."""
        return cls(tp_size=world_size, tp_rank=rank)

    @classmethod
    def of(cls, msg: LayoutFields) -> Layout:
        """The layout a request names; pipeline/expert sizes left at 0 (older clients) are 1.

        The one conversion every transport uses, so the gRPC stream and the side channel
        validate and plan the same layout for the same request.
        """
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

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.ep_size

    @property
    def global_rank(self) -> int:
        return (self.pp_rank * self.ep_size + self.ep_rank) * self.tp_size + self.tp_rank

    @property
    def is_trivial(self) -> bool:
        """One worker holds everything: nothing is cut, no rules are needed."""
        return self.world_size == 1

    def describe(self) -> str:
        parts = [f"tp {self.tp_rank}/{self.tp_size}"]
        if self.pp_size > 1:
            parts.append(f"pp {self.pp_rank}/{self.pp_size}")
        if self.ep_size > 1:
            parts.append(f"ep {self.ep_rank}/{self.ep_size}")
        if self.vocab_pad:
            parts.append(f"vocab_pad {self.vocab_pad}")
        return ", ".join(parts)

    def check(self) -> None:
        """Raise InvalidRequest naming the first field out of range."""
        # The TP messages are the core's ("world_size", "rank"): TP-only clients see them.
        if self.tp_size < 1:
            raise InvalidRequest(f"world_size {self.tp_size} is invalid: it must be at least 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidRequest(
                f"rank {self.tp_rank} is outside world_size {self.tp_size} "
                f"(valid: 0..{self.tp_size - 1})"
            )
        for size_name, rank_name in (
            ("tp_size", "tp_rank"),
            ("pp_size", "pp_rank"),
            ("ep_size", "ep_rank"),
        ):
            size, rank = getattr(self, size_name), getattr(self, rank_name)
            if size < 1 or size > MAX_PARALLEL_SIZE:
                raise InvalidRequest(
                    f"{size_name} {size} is invalid: it must be between 1 and {MAX_PARALLEL_SIZE}"
                )
            if not 0 <= rank < size:
                raise InvalidRequest(
                    f"{rank_name} {rank} is outside {size_name} {size} (valid: 0..{size - 1})"
                )
        if self.pp_layers:
            if len(self.pp_layers) != self.pp_size:
                raise InvalidRequest(
                    f"pp_layers lists {len(self.pp_layers)} stages but pp_size is {self.pp_size}"
                )
            if any(n < 0 for n in self.pp_layers):
                raise InvalidRequest(f"pp_layers {list(self.pp_layers)} has a negative count")
        if not 0 <= self.vocab_pad <= MAX_VOCAB_PAD:
            raise InvalidRequest(
                f"vocab_pad {self.vocab_pad} is invalid: it must be between 0 (equal blocks) "
                f"and {MAX_VOCAB_PAD}"
            )


def stage_ranges(
    num_layers: int, pp_size: int, pp_layers: Sequence[int] = ()
) -> list[tuple[int, int]]:
    """Each stage's ``[start, stop)`` of decoder layers.

    Explicit ``pp_layers`` must sum to ``num_layers``. The default split is vLLM's
    (``get_pp_indices``), so a weightd plan agrees with the engine most users run:
    equal blocks, and the remainder one layer each to the stages just before the
    last (the last stage also runs the final norm and the LM head).
    """
    if pp_layers:
        counts = list(pp_layers)
        if len(counts) != pp_size:
            raise InvalidRequest(f"pp_layers lists {len(counts)} stages but pp_size is {pp_size}")
        if sum(counts) != num_layers:
            raise ShardingError(
                f"pp_layers {counts} sums to {sum(counts)} layers; the model has "
                f"num_hidden_layers={num_layers}"
            )
    else:
        if pp_size > num_layers:
            raise ShardingError(
                f"pp_size {pp_size} exceeds num_hidden_layers={num_layers}: some stage would "
                "run no layer (pass explicit pp_layers if that is intended)"
            )
        counts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            counts[-i] += 1
    out: list[tuple[int, int]] = []
    start = 0
    for n in counts:
        out.append((start, start + n))
        start += n
    return out


def every_rank(
    tp_size: int,
    pp_size: int = 1,
    ep_size: int = 1,
    pp_layers: Sequence[int] = (),
    vocab_pad: int = 0,
) -> list[Layout]:
    """Every worker of a deployment, in global-rank order (tp fastest, then ep, then pp)."""
    return [
        Layout(tp_size, t, pp_size, p, ep_size, e, tuple(pp_layers), vocab_pad)
        for p in range(pp_size)
        for e in range(ep_size)
        for t in range(tp_size)
    ]
