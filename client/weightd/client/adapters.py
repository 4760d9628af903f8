"""Worker-side adapter helpers: fetch a rank's LoRA slices, watch for load/replace/unload.

A worker keeps one :func:`watch_adapters` stream open and refetches an adapter when
an event names a version it does not hold; each fetch carries the version it got, so
a worker always knows which version it applies (the daemon leases it for the fetch).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import grpc
import torch

from weightd.v1 import weightd_pb2 as pb

from .errors import DataLossError, from_rpc_error

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


@dataclass(frozen=True)
class AdapterEvent:
    kind: str  # "load" | "replace" | "unload"
    name: str
    version: int
    digest: str
    reason: str = ""


@dataclass(frozen=True)
class AdapterStatus:
    name: str
    version: int
    digest: str
    base_model: str
    nbytes: int
    pinned: bool
    leases: int
    source_dir: str


def status_of(s: pb.AdapterStatus) -> AdapterStatus:
    return AdapterStatus(
        s.name, s.version, s.digest, s.base_model, s.nbytes, s.pinned, s.leases, s.source_dir
    )


def fetch_adapter(
    stub: Any, name: str, rank: int, world_size: int, timeout: float | None, chunk_bytes: int
) -> AdapterWeights:
    from .client import receive_slices

    request = pb.FetchAdapterRequest(
        name=name,
        layout=pb.Layout(tp_size=world_size, tp_rank=rank),
        max_chunk_bytes=chunk_bytes,
    )
    first: list[pb.FetchResponse] = []
    tensors = receive_slices(stub.FetchAdapter(request, timeout=timeout), first)
    if not first or not first[0].HasField("adapter"):
        raise DataLossError(f"adapter {name!r}: the daemon did not say which version it sent")
    info = first[0].adapter
    return AdapterWeights(
        info.name, info.version, info.digest, info.base_model, dict(info.scaling), tensors
    )


class AdapterWatch:
    """An iterator of :class:`AdapterEvent`; ``close()`` (or ``with``) ends the stream."""

    def __init__(self, stub: Any, timeout: float | None) -> None:
        self._call = stub.WatchAdapters(pb.WatchAdaptersRequest(), timeout=timeout)

    def __iter__(self) -> Iterator[AdapterEvent]:
        try:
            for e in self._call:
                yield AdapterEvent(_KINDS[e.kind], e.name, e.version, e.digest, e.reason)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.CANCELLED:
                return
            raise from_rpc_error(exc) from None

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> AdapterWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
