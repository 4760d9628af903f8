"""Publishing a trainer's tensors from memory: no checkpoint written to disk.

The tensors are laid out once as one safetensors file (8-byte header length, JSON
header, data) in a memfd the trainer creates, then sealed (``F_SEAL_SHRINK | GROW |
WRITE | SEAL``): one copy from the trainer's tensors, and from then on nobody (the
trainer included) can change a byte the daemon hashes. On the daemon's host the memfd
itself goes over the admin side socket (``<admin socket>.local``, ``SCM_RIGHTS``);
from another host (or where the admin listener is TCP) the same bytes stream over
the ``PublishTensors`` gRPC call in 1 MiB chunks, into a memfd the daemon seals.
Either way the daemon checks every name, shape and dtype against the serving
version, hashes each byte once, builds the packs in use and publishes; the call
returns the new version number.

torch is imported only when torch tensors are handed over: :class:`RawTensor` (a
safetensors dtype, a shape and the bytes) needs nothing but the standard library,
which is what the ``weightd publish --tensors`` CLI uses.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from weightd.common.dtypes import DTYPE_BITS, nbytes_for
from weightd.common.frames import FrameError, recv_frame, send_frame
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

from ..base.errors import InvalidArgumentError, UnavailableError, WeightdError, error_for

if TYPE_CHECKING:
    import torch

#: The name of a trainer's memfd (``/proc/<pid>/fd`` shows ``/memfd:weightd-trainer``).
TRAINER_MEMFD_NAME: Final = "weightd-trainer"
#: Every seal the trainer sets (the daemon requires the first three).
SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
#: Bytes per PublishTensors chunk (1 MiB streamed fastest here; the daemon takes 4 MiB).
CHUNK_BYTES: Final = 1 << 20
#: The admin side socket's name beside the admin socket.
SIDE_SUFFIX: Final = ".local"

_TORCH_NAMES: Final = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "complex64": "C64",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}


@dataclass(frozen=True)
class RawTensor:
    """One tensor as safetensors stores it: ``dtype`` (``"BF16"``), ``shape``, and its
    bytes, C-contiguous, exactly ``nbytes_for(dtype, shape)`` of them."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview


def _from_torch(name: str, t: torch.Tensor) -> RawTensor:
    import torch

    dtype = _TORCH_NAMES.get(str(t.dtype).removeprefix("torch."))
    if dtype is None:
        raise InvalidArgumentError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
    flat = t.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().reshape(-1).view(torch.uint8)
    data = memoryview(flat.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    return RawTensor(dtype, tuple(int(d) for d in t.shape), data)


def raw_tensors(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
) -> list[tuple[str, RawTensor]]:
    """``(name, RawTensor)`` for each of ``tensors`` (torch tensors or RawTensors), in
    the order given; a duplicate name or a size that disagrees with the shape is the
    caller's mistake, refused here before anything is sent."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    out: list[tuple[str, RawTensor]] = []
    seen: set[str] = set()
    for name, t in items:
        if name in seen:
            raise InvalidArgumentError(f"tensor {name!r} is given twice")
        seen.add(name)
        raw = t if isinstance(t, RawTensor) else _from_torch(name, t)
        if raw.dtype not in DTYPE_BITS:
            raise InvalidArgumentError(f"tensor {name!r}: {raw.dtype!r} is no safetensors dtype")
        want = nbytes_for(raw.dtype, raw.shape)
        if want != raw.data.nbytes:
            raise InvalidArgumentError(
                f"tensor {name!r}: {raw.data.nbytes} bytes for {raw.dtype}{list(raw.shape)} "
                f"(expected {want})"
            )
        out.append((name, raw))
    return out


def header_of(raws: list[tuple[str, RawTensor]]) -> bytes:
    """The safetensors prefix (length + JSON header, padded to 8 bytes) for ``raws``
    laid out in that order."""
    doc: dict[str, Any] = {}
    pos = 0
    for name, raw in raws:
        doc[name] = {
            "dtype": raw.dtype,
            "shape": list(raw.shape),
            "data_offsets": [pos, pos + raw.data.nbytes],
        }
        pos += raw.data.nbytes
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def memfd_of(raws: list[tuple[str, RawTensor]], *, seal: bool = True) -> tuple[int, int]:
    """A memfd holding ``raws`` as one safetensors file, sealed (``seal=False`` is for
    tests of the daemon's refusal). Returns ``(fd, size)``; the caller closes ``fd``."""
    head = header_of(raws)
    size = len(head) + sum(r.data.nbytes for _, r in raws)
    fd = os.memfd_create(TRAINER_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        _pwrite_all(fd, memoryview(head), 0)
        pos = len(head)
        for _, raw in raws:
            _pwrite_all(fd, raw.data.cast("B"), pos)
            pos += raw.data.nbytes
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _local_error(err: lpb.LocalError) -> WeightdError:
    return error_for(err.code, err.detail, reason=err.reason, metadata=dict(err.metadata))


def _answer(sock: socket.socket) -> lpb.LocalResponse:
    got = recv_frame(sock)
    if got is None:
        raise UnavailableError("the daemon closed the admin side socket without an answer")
    response = lpb.LocalResponse.FromString(got[0])
    if response.WhichOneof("response") == "error":
        raise _local_error(response.error)
    return response


def publish_fd(
    path: str, fd: int, size: int, model: str = "", timeout: float | None = None
) -> pb.PublishResponse:
    """Hand the sealed memfd ``fd`` (``size`` bytes) to the daemon's admin side socket
    at ``path`` and wait for the version to be published (``fd`` stays the caller's)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            got = recv_frame(sock)
            if got is None:
                raise UnavailableError(f"{path} closed the connection before its hello")
            hello = lpb.LocalHello.FromString(got[0])
            if hello.HasField("refused"):
                raise _local_error(hello.refused)
            ask = lpb.LocalRequest(publish=lpb.PublishTensors(model=model, nbytes=size))
            send_frame(sock, ask.SerializeToString())
            _answer(sock)  # publish_ready
            hand = lpb.LocalRequest(publish_memfd=lpb.PublishMemfd(nbytes=size))
            send_frame(sock, hand.SerializeToString(), [fd])
            return _answer(sock).published
        except (OSError, FrameError) as exc:
            raise UnavailableError(f"publishing through {path} failed: {exc}") from None


def chunks_of(
    raws: list[tuple[str, RawTensor]], model: str = "", chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.PublishTensorsChunk]:
    """The PublishTensors stream for ``raws``: the first chunk names the model and the
    size, every chunk carries at most ``chunk_bytes`` of the file."""
    head = header_of(raws)
    total = len(head) + sum(r.data.nbytes for _, r in raws)
    first = True

    def views() -> Iterator[memoryview]:
        yield memoryview(head)
        for _, raw in raws:
            yield raw.data.cast("B")

    pending = bytearray()
    for view in views():
        pos = 0
        while pos < len(view):
            take = min(chunk_bytes - len(pending), len(view) - pos)
            pending += view[pos : pos + take]
            pos += take
            if len(pending) == chunk_bytes:
                if first:
                    yield pb.PublishTensorsChunk(
                        model=model, total_bytes=total, data=bytes(pending)
                    )
                    first = False
                else:
                    yield pb.PublishTensorsChunk(data=bytes(pending))
                pending.clear()
    if pending or first:
        if first:
            yield pb.PublishTensorsChunk(model=model, total_bytes=total, data=bytes(pending))
        else:
            yield pb.PublishTensorsChunk(data=bytes(pending))
