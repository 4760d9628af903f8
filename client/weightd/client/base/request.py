"""What a fetch asks for, and how its tensors are delivered: the two values a fetch passes down.

Why values: a fetch relayed its options as ten to thirteen keyword arguments through
seven calls in four modules (``WeightClient.fetch`` down to the side channel's wire
encoding), so a new option meant editing every one of them and each could drop it on
the way. Now the public calls build one :class:`Wanted` (what the daemon is asked for)
and one :class:`Delivery` (how the tensors reach the caller) where the caller's
keywords arrive, and every call below passes them whole: a new option is one field
here, read where it is used. :class:`DeliveryOptions` is the part of
:class:`Delivery` a caller sets by keyword (``fetch(..., copy=True)``).

Light on purpose (the dataclasses module and the layout): the side channel's encoder
reads :class:`Wanted` on a fresh worker's first fetch, before torch is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypedDict

from .errors import InvalidArgumentError
from .layout import Layout

if TYPE_CHECKING:
    import torch

Transport = Literal["auto", "grpc", "shm", "cuda_ipc"]
"""How a fetch may travel: ``"auto"`` picks the fastest that applies, the others insist."""
Transport.__doc__ = "How a fetch may travel: ``auto`` picks the fastest that applies."


@dataclass(frozen=True)
class Wanted:
    """What a fetch asks the daemon for: the tensors one worker holds of one model version.

    ``layout``: where the worker sits (its tensor-parallel rank, pipeline stage,
    expert rank). ``model``: the served model's name (``""``: the daemon's only model).
    ``names``: only these tensors (empty: every tensor the layout holds). ``version``:
    that version of the model (0: the current one). ``adapter``: the current version
    of that LoRA adapter instead of the model's weights.
    """

    layout: Layout
    model: str = ""
    names: tuple[str, ...] = ()
    version: int = 0
    adapter: str = ""


def tp_layout(rank: int, world_size: int) -> Layout:
    """The layout of tensor-parallel ``rank`` of ``world_size`` (what ``fetch`` takes)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"rank {rank} / world_size {world_size} is invalid: need 0 <= rank < world_size"
        )
    return Layout(tp_size=world_size, tp_rank=rank)


class DeliveryOptions(TypedDict, total=False):
    """The keywords a fetch call takes for its :class:`Delivery` (each optional).

    ``transport``: ``"auto"`` (CUDA IPC for a CUDA device on the daemon's host, shared
    memory for a fetch on its host, gRPC otherwise), or ``"grpc"``, ``"shm"``,
    ``"cuda_ipc"`` to insist. ``device``: where the tensors are (default ``"cpu"``).
    ``copy``: private tensors instead of views of the pack every process on the host
    shares. ``verify``: re-hash a shared pack (gRPC always checks digests). ``streams``:
    over gRPC, this many concurrent streams (1 to 16); same-host transports ignore it.
    """

    transport: Transport
    device: str | torch.device
    copy: bool
    verify: bool
    streams: int


#: The keywords :class:`DeliveryOptions` names: what a fetch call accepts beyond its own.
DELIVERY_KEYWORDS = frozenset(DeliveryOptions.__optional_keys__)


@dataclass(frozen=True)
class Delivery:
    """How a fetch's tensors reach the caller: :class:`DeliveryOptions`, plus what the
    client decides itself.

    ``into``: tensors to receive into where dtype and shape match (a gRPC fetch by
    ``load_into``: no second copy of the rank in memory). ``populate``: map a shared
    pack with every page resident (the client's ``populate``; None: where the pack is
    in huge pages).
    """

    transport: Transport = "auto"
    device: str | torch.device = "cpu"
    copy: bool = False
    verify: bool = False
    streams: int = 1
    into: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    populate: bool | None = None

    @classmethod
    def of(
        cls,
        options: DeliveryOptions,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        populate: bool | None = None,
    ) -> Delivery:
        """The delivery a call's keywords ask for; an unknown keyword is a TypeError, as
        for any Python call."""
        unknown = sorted(set(options) - DELIVERY_KEYWORDS)
        if unknown:
            raise TypeError(
                f"unexpected keyword argument(s) {unknown}; a fetch takes "
                f"{sorted(DELIVERY_KEYWORDS)} besides its own"
            )
        return cls(**options, into=into, populate=populate)

    def torch_device(self) -> torch.device:
        """:attr:`device` as a ``torch.device`` (imports torch)."""
        import torch

        return torch.device(self.device)
