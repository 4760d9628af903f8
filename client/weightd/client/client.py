"""``WeightClient``: fetch a rank's verified slices from a weightd daemon.

On the daemon's host, ``transport="auto"`` maps shared rank packs or opens CUDA IPC
handles instead (``local_fetch``, ``shm``, ``cuda_ipc``); this module is the gRPC path.

Copies, end to end, for each byte fetched over gRPC (``transport="grpc"``):

1. daemon: page cache → a read buffer (``pread``/``preadv``);
2. daemon: protobuf serialisation into gRPC's send buffers;
3. client: gRPC receive buffers → the protobuf message's ``bytes`` field;
4. client: that ``bytes`` object → the final, preallocated tensor (one ``memmove``).

Nothing is assembled twice: each tensor is allocated once, at its final shape, when
its header arrives, and every chunk is written straight into place. The SHA-256 of
each slice is computed over the same chunk buffers and checked before ``fetch``
returns; a tensor whose digest does not match is never handed out.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from weightd.common.digests import slice_digest
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

from .adapters import AdapterWatch, AdapterWeights, fetch_adapter
from .dtypes import torch_dtype
from .errors import DataLossError, InvalidArgumentError, WeightdError, from_rpc_error
from .layout import Layout
from .local_fetch import attach_local, negotiated_fetch
from .transports import FetchInfo, PackRef, Transport

#: Largest message the client accepts: the daemon caps tensor payload at 4 MiB per
#: message; the rest is headroom for headers of many small tensors sharing a message.
MAX_MESSAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    total_bytes: int
    num_tensors: int
    ready: bool
    #: "loading", "ready", "stale" (still serving its verified files, replaced on disk)
    #: or "broken"; "" from a daemon that predates the field.
    state: str = ""
    reason: str = ""  # why, when not ready: names the file and what changed


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    nbytes: int
    digest: str


@dataclass(frozen=True)
class ModelDescription:
    name: str
    architecture: str
    config_json: str
    total_bytes: int
    tensors: tuple[TensorInfo, ...]


class _Incoming:
    """One tensor being received: its final storage, a write cursor and a running hash."""

    __slots__ = ("address", "hasher", "name", "nbytes", "received", "tensor")

    def __init__(self, header: pb.SliceHeader) -> None:
        self.name = header.name
        dtype, shape = torch_dtype(header.dtype, tuple(header.shape))
        self.tensor = torch.empty(shape, dtype=dtype)
        self.nbytes = header.nbytes
        actual = self.tensor.numel() * self.tensor.element_size()
        if actual != self.nbytes:
            raise DataLossError(
                f"tensor {self.name!r}: header says {self.nbytes} bytes, "
                f"{header.dtype} {list(header.shape)} holds {actual}"
            )
        self.address = self.tensor.data_ptr()
        self.received = 0
        self.hasher = hashlib.sha256()

    def write(self, chunk: pb.TensorChunk) -> None:
        data = chunk.data
        if chunk.offset != self.received or self.received + len(data) > self.nbytes:
            raise DataLossError(
                f"tensor {self.name!r}: chunk at offset {chunk.offset} (+{len(data)}) does not "
                f"follow the {self.received} of {self.nbytes} bytes received"
            )
        if data:
            ctypes.memmove(self.address + self.received, data, len(data))
            self.hasher.update(data)
        self.received += len(data)

    def finish(self, digest: str) -> torch.Tensor:
        if self.received != self.nbytes:
            raise DataLossError(
                f"tensor {self.name!r}: digest arrived after {self.received} of {self.nbytes} bytes"
            )
        actual = slice_digest(self.hasher)
        if actual != digest:
            raise DataLossError(
                f"tensor {self.name!r}: received bytes hash to {actual}, the daemon sent {digest}"
            )
        return self.tensor


def receive_slices(
    stream: Any, first: list[pb.FetchResponse] | None = None
) -> dict[str, torch.Tensor]:
    """Every slice of a Fetch-format stream, digest-checked; never a partial result.

    ``first``, when given (empty), receives the stream's first message (FetchAdapter
    names the adapter version there).
    """
    out: dict[str, torch.Tensor] = {}
    incoming: list[_Incoming] = []
    done: pb.FetchDone | None = None
    try:
        for response in stream:
            if first is not None and not first:
                first.append(response)
            if done is not None:
                raise DataLossError("the daemon sent data after closing the stream")
            for chunk in response.chunks:
                if chunk.HasField("header"):
                    if chunk.index != len(incoming):
                        raise DataLossError(
                            f"tensor header {chunk.index} arrived after {len(incoming)} headers"
                        )
                    incoming.append(_Incoming(chunk.header))
                elif chunk.index >= len(incoming):
                    raise DataLossError(f"chunk for tensor {chunk.index} arrived before its header")
                item = incoming[chunk.index]
                item.write(chunk)
                if chunk.digest:
                    if item.name in out:
                        raise DataLossError(f"tensor {item.name!r} was sent twice")
                    out[item.name] = item.finish(chunk.digest)
            if response.HasField("done"):
                done = response.done
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    except WeightdError:
        stream.cancel()
        raise
    if done is None:
        raise DataLossError("the stream ended before the daemon marked it complete")
    if done.num_tensors != len(out) or len(incoming) != len(out):
        raise DataLossError(
            f"the daemon announced {done.num_tensors} tensors; {len(out)} arrived complete"
        )
    return out


class WeightClient:
    """A connection to one weightd daemon.

    ``target`` is any gRPC target string: ``unix:///run/weightd/weightd.sock``,
    ``localhost:7070``, ``dns:///host:7070``. ``timeout`` bounds each call in seconds.
    Pass ``credentials`` (``grpc.ssl_channel_credentials(...)``) for TLS.
    """

    #: How the latest fetch was served (also returned by :meth:`fetch_with_info`).
    last_fetch: FetchInfo | None = None

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        chunk_bytes: int = 0,
    ) -> None:
        opts = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *options,
        ]
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=opts)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=opts)
        self._stub = pb_grpc.WeightsStub(self._channel)
        self.target = target
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> WeightClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- metadata --------------------------------------------------------------------

    def fetch_adapter(self, name: str, rank: int, world_size: int) -> AdapterWeights:
        """Rank ``rank``'s slices of the current version of adapter ``name`` (gRPC)."""
        return fetch_adapter(self._stub, name, rank, world_size, self.timeout, self.chunk_bytes)

    def watch_adapters(self, timeout: float | None = None) -> AdapterWatch:
        """Adapter events: a load for each adapter loaded now, then every change in order."""
        return AdapterWatch(self._stub, timeout)

    def list_models(self) -> list[ModelInfo]:
        try:
            reply = self._stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return [
            ModelInfo(
                m.name, m.architecture, m.total_bytes, m.num_tensors, m.ready, m.state, m.reason
            )
            for m in reply.models
        ]

    def describe(self, model: str | None = None) -> ModelDescription:
        try:
            d = self._stub.DescribeModel(
                pb.DescribeModelRequest(model=model or ""), timeout=self.timeout
            )
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return ModelDescription(
            d.name,
            d.architecture,
            d.config_json,
            d.total_bytes,
            tuple(
                TensorInfo(t.name, t.dtype, tuple(t.shape), t.shard, t.nbytes, t.digest)
                for t in d.tensors
            ),
        )

    # --- weights ---------------------------------------------------------------------

    def fetch(
        self,
        rank: int,
        world_size: int,
        *,
        model: str | None = None,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        transport: Transport = "auto",
        copy: bool = False,
        verify: bool = False,
    ) -> dict[str, torch.Tensor]:
        """This tensor-parallel rank's slice of every tensor (or of ``names``).

        ``transport``: ``"auto"`` (CUDA IPC for a CUDA device on the daemon's host, shared
        memory for a CPU fetch on its host, gRPC otherwise), or ``"grpc"``, ``"shm"``,
        ``"cuda_ipc"`` to insist. Shared-memory and CUDA IPC tensors view one copy shared
        by every process on the host; ``copy=True`` returns private tensors instead.
        ``verify=True`` re-hashes shared packs (gRPC always checks digests). How the
        fetch was served is in :attr:`last_fetch`, or use :meth:`fetch_with_info`.
        Pipeline and expert layouts: :meth:`fetch_layout`. Raises a
        :class:`~weightd.client.errors.WeightdError` subclass; a partial result is
        never returned.
        """
        state, _ = self.fetch_with_info(
            rank,
            world_size,
            model=model,
            names=names,
            device=device,
            transport=transport,
            copy=copy,
            verify=verify,
        )
        return state

    def fetch_with_info(
        self,
        rank: int,
        world_size: int,
        *,
        model: str | None = None,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        transport: Transport = "auto",
        copy: bool = False,
        verify: bool = False,
    ) -> tuple[dict[str, torch.Tensor], FetchInfo]:
        """:meth:`fetch`, and how it was served (transport, reason, failures, pack)."""
        if world_size < 1 or not 0 <= rank < world_size:
            # Checked here too: a negative number cannot even be encoded as uint32.
            raise InvalidArgumentError(
                f"rank {rank} / world_size {world_size} is invalid: need 0 <= rank < world_size"
            )
        wanted = list(names or ())
        state, info = negotiated_fetch(
            self.target,
            transport,
            lambda: self._fetch_grpc(
                Layout(tp_size=world_size, tp_rank=rank), model=model, names=wanted
            ),
            model=model or "",
            world_size=world_size,
            rank=rank,
            names=wanted,
            device=torch.device(device),
            copy=copy,
            verify=verify,
            timeout=self.timeout,
        )
        self.last_fetch = info
        return state, info

    def fetch_layout(
        self,
        layout: Layout,
        *,
        model: str | None = None,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Every tensor the worker at ``layout`` holds (or ``names``), sliced, digest-checked.

        A pipeline stage receives only its layers' tensors (and the embeddings, norm and
        head its position needs); an expert-parallel rank only its experts. Asking by
        name for a tensor another worker holds is ``InvalidArgumentError``. Served over
        gRPC; the same-host transports serve tensor-parallel layouts, through :meth:`fetch`.
        """
        layout.check()
        out = self._fetch_grpc(layout, model=model, names=names)
        if torch.device(device).type != "cpu":
            return {name: t.to(device) for name, t in out.items()}
        return out

    def attach(
        self,
        ref: PackRef,
        *,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        copy: bool = False,
        verify: bool = False,
    ) -> tuple[dict[str, torch.Tensor], FetchInfo]:
        """Take a lease of your own on a pack another local process fetched (``info.pack``).

        Refused (FailedPreconditionError) when the daemon restarted since ``ref`` was
        granted: its handle would name memory that no longer exists.
        """
        state, info = attach_local(
            self.target,
            ref,
            names=list(names or ()),
            device=torch.device(device),
            copy=copy,
            verify=verify,
            timeout=self.timeout,
        )
        self.last_fetch = info
        return state, info

    def _fetch_grpc(
        self,
        layout: Layout,
        *,
        model: str | None = None,
        names: Iterable[str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The layout's slices, streamed and digest-checked, on the CPU.

        Raises a :class:`~weightd.client.errors.WeightdError` subclass carrying the
        daemon's status code and detail; a partial result is never returned.
        """
        request = pb.FetchRequest(
            model=model or "",
            layout=layout.to_proto(),
            names=list(names or ()),
            max_chunk_bytes=self.chunk_bytes,
        )
        return receive_slices(self._stub.Fetch(request, timeout=self.timeout))

    def load_into(
        self,
        module: torch.nn.Module,
        rank: int,
        world_size: int,
        *,
        model: str | None = None,
        strict: bool = True,
    ) -> None:
        """Fetch this rank's slices and load them into ``module``.

        With ``strict``, every parameter and buffer the module has must be fetched,
        except parameters tied to (the very same object as) a fetched one, such as
        ``lm_head.weight`` under ``tie_word_embeddings``; and every fetched tensor
        must exist in the module.
        """
        state = self.fetch(rank, world_size, model=model)
        result = module.load_state_dict(state, strict=False)
        if not strict:
            return
        params = dict(module.named_parameters(remove_duplicate=False))
        loaded_ids = {id(params[n]) for n in state if n in params}
        missing = [k for k in result.missing_keys if id(params.get(k)) not in loaded_ids]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"state from {self.target} does not match {type(module).__name__}: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {result.unexpected_keys[:5]}"
            )
