"""Worker-side adapter helpers: fetch a rank's LoRA slices, watch for load/replace/unload.

A worker keeps one :func:`watch_adapters` stream open and refetches an adapter when
an event names a version it does not hold; each fetch carries the version it got, so
a worker always knows which version it applies (the daemon leases it for the fetch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from weightd.common.watch import EventStream
from weightd.v1 import weightd_pb2 as pb

from ..base.errors import DataLossError, InvalidArgumentError, watch_failed
from ..base.request import Delivery, Wanted
from ..receive.fetchwire import WireResponse
from ..receive.stream import receive_all
from ..transports.selection import FetchInfo
from .adapter_files import AdapterStatus, status_of

__all__ = [
    "AdapterEvent",
    "AdapterStatus",
    "AdapterWatch",
    "AdapterWeights",
    "fetch_adapter",
    "fetch_adapter_via",
    "status_of",
]

_KINDS: Final = {
    pb.AdapterEvent.LOAD: "load",
    pb.AdapterEvent.REPLACE: "replace",
    pb.AdapterEvent.UNLOAD: "unload",
}


@dataclass(frozen=True)
class AdapterWeights:
    """One rank's slices of one adapter version: ``<module>.lora_{A,B}.weight`` tensors."""

    name: str
    version: int
    digest: str
    base_model: str
    scaling: dict[str, float]  # module -> factor applied to B @ A @ x
    tensors: dict[str, torch.Tensor]
    #: How they were served: ``info.transport`` is "grpc", "shm" or "cuda_ipc"; for
    #: "auto", ``info.reason`` and ``info.fallbacks`` say why (as for base fetches).
    info: FetchInfo | None = None

    @property
    def transport(self) -> str:
        """What delivered the tensors: ``"grpc"``, ``"shm"`` or ``"cuda_ipc"``."""
        return self.info.transport if self.info is not None else "grpc"


@dataclass(frozen=True)
class AdapterEvent:
    """One change of the daemon's adapters, as :class:`AdapterWatch` yields it: ``kind``
    is ``"load"``, ``"replace"`` (a new version under the name) or ``"unload"``; the
    version and digest are the one now served (the one gone, for an unload, whose
    ``reason`` says ``"unloaded"`` or ``"evicted"``)."""

    kind: str  # "load" | "replace" | "unload"
    name: str
    version: int
    digest: str
    reason: str = ""


def fetch_adapter(
    stub: Any, name: str, rank: int, world_size: int, timeout: float | None, chunk_bytes: int
) -> AdapterWeights:
    request = pb.FetchAdapterRequest(
        name=name,
        layout=pb.Layout(tp_size=world_size, tp_rank=rank),
        max_chunk_bytes=chunk_bytes,
    )
    first: list[WireResponse] = []
    tensors = receive_all(stub.FetchAdapter(request, timeout=timeout), first)
    info = first[0].adapter if first else None
    if info is None:
        raise DataLossError(f"adapter {name!r}: the daemon did not say which version it sent")
    return AdapterWeights(
        info.name, info.version, info.digest, info.base_model, dict(info.scaling), tensors
    )


def fetch_adapter_via(
    target: str,
    stub: Any,
    wanted: Wanted,
    delivery: Delivery,
    *,
    timeout: float | None,
    chunk_bytes: int,
) -> AdapterWeights:
    """:func:`fetch_adapter` over the transport ``negotiated_fetch`` picks, like base fetches.

    ``wanted.adapter`` names the adapter, ``wanted.layout`` the tensor-parallel rank.
    Over shared memory / CUDA IPC the tensors view the adapter version's pack, whose
    lease (held while any tensor lives, or until ``copy`` made private ones) also holds
    that version in the daemon: an unload or replace cannot free what a worker maps.
    """
    from ..transports.local_fetch import negotiated_fetch

    name, layout = wanted.adapter, wanted.layout
    if delivery.streams != 1:
        raise InvalidArgumentError(f"adapter {name!r}: an adapter is fetched on one stream")
    streamed: list[AdapterWeights] = []

    def grpc_fetch() -> dict[str, torch.Tensor]:
        got = fetch_adapter(stub, name, layout.tp_rank, layout.tp_size, timeout, chunk_bytes)
        streamed.append(got)
        return got.tensors

    tensors, info = negotiated_fetch(target, grpc_fetch, wanted, delivery, timeout=timeout)
    if info.transport == "grpc":
        got = streamed[-1]
        return AdapterWeights(
            got.name, got.version, got.digest, got.base_model, got.scaling, tensors, info
        )
    ref = info.pack.adapter if info.pack is not None else None
    if ref is None or ref.name != name:
        raise DataLossError(f"adapter {name!r}: the daemon granted a pack of something else")
    return AdapterWeights(
        ref.name, ref.version, ref.digest, ref.base_model, dict(ref.scaling), tensors, info
    )


class AdapterWatch(EventStream[pb.AdapterEvent, AdapterEvent]):
    """An iterator of :class:`AdapterEvent`; ``close()`` (or ``with``) ends the stream."""

    def __init__(self, stub: Any, timeout: float | None) -> None:
        call = stub.WatchAdapters(pb.WatchAdaptersRequest(), timeout=timeout)
        super().__init__(call, _event, watch_failed)


def _event(e: pb.AdapterEvent) -> AdapterEvent:
    return AdapterEvent(_KINDS[e.kind], e.name, e.version, e.digest, e.reason)
