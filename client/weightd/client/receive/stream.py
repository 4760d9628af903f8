"""Receiving a Fetch-format stream into final tensors, resumably.

Each tensor is allocated once, at its final shape, when its header arrives, and
every chunk is written straight into place (into pages the kernel populated for it
just before, for big tensors: :class:`_Populate`); the digest of each slice (SHA-256, or
BLAKE3 when the client asked and the daemon named it in the stream's first message)
is computed over the same chunk buffers and checked before the tensor counts as
received.

A :class:`RankReceiver` keeps what it received completely across streams. Tensors
arrive in the rank's plan order, so what it holds is always a prefix of that order:
when a stream is cut (the daemon restarted), the next stream asks for the rest with
``start_index = next_index``, and only the tensor that was in flight is sent again.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import grpc
import torch

from weightd.common.digests import SLICE_DIGEST_ALGORITHM, slice_digest
from weightd.v1 import weightd_pb2 as pb

from ..base.errors import (
    DataLossError,
    DigestMismatchError,
    FailedPreconditionError,
    VocabPadUnsupportedError,
    WeightdError,
    from_rpc_error,
)
from .dtypes import torch_dtype
from .fetchwire import WireChunk, WireResponse, from_message, parse_fetch_response
from .hashers import new_hasher

#: Called after each complete tensor with (its index in the rank, its name).
ProgressFn = Callable[[int, str], None]


class _Incoming:
    """One tensor being received: its final storage, a write cursor and a running hash."""

    __slots__ = ("address", "hasher", "kind", "name", "nbytes", "received", "storage", "tensor")

    def __init__(
        self,
        header: pb.SliceHeader,
        into: torch.Tensor | None = None,
        kind: str = SLICE_DIGEST_ALGORITHM,
    ) -> None:
        self.name = header.name
        dtype, shape = torch_dtype(header.dtype, tuple(header.shape))
        self.tensor = (
            into
            if into is not None and fits(into, dtype, shape)
            else torch.empty(shape, dtype=dtype)
        )
        self.nbytes = header.nbytes
        actual = self.tensor.numel() * self.tensor.element_size()
        if actual != self.nbytes:
            raise DataLossError(
                f"tensor {self.name!r}: header says {self.nbytes} bytes, "
                f"{header.dtype} {list(header.shape)} holds {actual}"
            )
        #: The tensor's bytes as a writable memoryview: chunks are copied in by slice
        #: assignment, straight from the received message (see :mod:`.fetchwire`).
        self.storage = memoryview((ctypes.c_char * actual).from_address(self.tensor.data_ptr()))
        self.storage = self.storage.cast("B")
        #: Where a fresh, big tensor's memory starts (0: leave its pages to fault in).
        fresh = self.tensor is not into and actual >= POPULATE_MIN_BYTES
        self.address = self.tensor.data_ptr() if fresh else 0
        self.received = 0
        self.kind = kind
        self.hasher = new_hasher(kind)

    def write(self, chunk: WireChunk) -> None:
        data = chunk.data
        size = data.nbytes
        if chunk.offset != self.received or self.received + size > self.nbytes:
            raise DataLossError(
                f"tensor {self.name!r}: chunk at offset {chunk.offset} (+{size}) does not "
                f"follow the {self.received} of {self.nbytes} bytes received"
            )
        if size:
            if self.address:
                populate(self.address + self.received, size)
            self.storage[self.received : self.received + size] = data
            self.hasher.update(data)
        self.received += size

    def finish(self, digest: str) -> torch.Tensor:
        if self.received != self.nbytes:
            raise DataLossError(
                f"tensor {self.name!r}: digest arrived after {self.received} of {self.nbytes} bytes"
            )
        actual = slice_digest(self.hasher, self.kind)
        if actual != digest:
            raise DigestMismatchError(
                f"tensor {self.name!r}: received bytes hash to {actual}, the daemon sent {digest}"
            )
        return self.tensor


#: Tensors of at least this many bytes have their pages populated ahead of each chunk.
POPULATE_MIN_BYTES: Final = 1 << 20
#: ``MADV_POPULATE_WRITE`` (Linux 5.14, <asm-generic/mman-common.h>); not in Python 3.11's mmap.
MADV_POPULATE_WRITE: Final = 23
_PAGE: Final = mmap.PAGESIZE


class _Populate:
    """``madvise(MADV_POPULATE_WRITE)`` through libc; switched off after its first refusal.

    Why: a fetched tensor is fresh memory, and writing fresh memory costs a page fault
    per 4 KiB page (PERFORMANCE.md). Asking the kernel to populate the pages a chunk is
    about to fill costs one system call per chunk instead of 256 faults per MiB, and
    measurably less CPU per byte received (the gRPC notebook in ``docs/notes/``). Done
    chunk by chunk, not for the whole tensor at once,
    so the work stays spread over the stream as the faults were (populating a big
    tensor up front stalled the daemon behind flow control while the client zeroed
    it). The tensors stay ordinary ``torch.empty`` tensors. A kernel without the
    advice (EINVAL) or a platform without libc's ``madvise`` just takes the faults.
    """

    def __init__(self) -> None:
        self.call: Callable[[int, int, int], int] | None = None
        if sys.platform != "linux":
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        self.call = madvise

    def __call__(self, address: int, size: int) -> None:
        """Populate the whole pages inside ``[address, address + size)`` for writing."""
        call = self.call
        if call is None:
            return
        start = (address + _PAGE - 1) & -_PAGE
        end = (address + size) & -_PAGE
        if end > start and call(start, end - start, MADV_POPULATE_WRITE) != 0:
            self.call = None  # refused (an older kernel): page faults, as before


populate = _Populate()


def fits(dest: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether a slice can be received straight into ``dest``'s memory.

    Only a plain, dense, contiguous CPU tensor of exactly the slice's dtype and shape
    takes the bytes as they are; anything else (another device, a cast, a view with
    strides, a tensor subclass such as a DTensor, whose memory is not simply its
    bytes) gets a fresh tensor and is left to the caller's own copy, which casts or
    refuses as ``load_state_dict`` does.
    """
    return (
        type(dest) in (torch.Tensor, torch.nn.Parameter)
        and dest.device.type == "cpu"
        and dest.layout == torch.strided
        and dest.dtype == dtype
        and tuple(dest.shape) == shape
        and dest.is_contiguous()
        and not dest.is_quantized
        and not dest.is_neg()
        and not dest.is_conj()
    )


class RankReceiver:
    """The complete tensors of one rank, gathered from one stream or several.

    ``into``: tensors (by name) to receive slices into instead of fresh memory, where
    they fit (:func:`fits`). Loading a module this way skips a fresh allocation and a
    copy per tensor and never holds the rank twice. The price: a fetch that fails
    may leave some of them overwritten, with bytes that were not checked.
    """

    @classmethod
    def for_request(
        cls,
        request: pb.FetchRequest,
        on_tensor: ProgressFn | None = None,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> RankReceiver:
        """A receiver for the streams of ``request``: the digest kind, ``vocab_pad`` and
        version it asks for are what each stream must confirm."""
        return cls(
            on_tensor,
            into,
            asked=request.slice_digest,
            vocab_pad=request.layout.vocab_pad,
            version=request.version,
        )

    def __init__(
        self,
        on_tensor: ProgressFn | None = None,
        into: Mapping[str, torch.Tensor] | None = None,
        *,
        asked: str = "",
        vocab_pad: int = 0,
        version: int = 0,
    ) -> None:
        self.on_tensor = on_tensor
        #: The model version the requests ask for (0: the current one); each stream
        #: must name it.
        self.version = version
        self.into = into or {}
        #: The slice digest kind the requests ask for ("": the default, SHA-256).
        self.asked = asked
        #: The ``Layout.vocab_pad`` the requests ask for; each stream must confirm it.
        self.vocab_pad = vocab_pad
        #: The kind of the current stream's digests, from its first message.
        self.kind = SLICE_DIGEST_ALGORITHM
        self.tensors: dict[str, torch.Tensor] = {}
        #: The model content the tensors came from (FetchResponse.model_fingerprint).
        self.fingerprint = ""
        #: The first message of the latest stream (FetchAdapter names its version there).
        self.first: WireResponse | None = None
        #: Payload bytes received, and those thrown away with a tensor left incomplete.
        self.received_bytes = 0
        self.discarded_bytes = 0

    @property
    def next_index(self) -> int:
        """Where the next stream starts: every tensor before it is held, checked."""
        return len(self.tensors)

    def reset(self) -> None:
        """Forget everything (the daemon's content changed): the next stream starts at 0."""
        self.discarded_bytes += total_bytes(self.tensors.values())
        self.tensors = {}
        self.fingerprint = ""

    def consume(self, stream: Any) -> None:
        """Read one stream, starting at :attr:`next_index`, to its ``done`` message.

        The stream yields ``FetchResponse`` messages, or their wire bytes (a Fetch
        called with no response deserializer, as :class:`~.client.WeightClient` does:
        :func:`~.fetchwire.parse_fetch_response` then reads them without copying the
        payload). Raises a :class:`~weightd.client.base.errors.WeightdError`; the tensors
        completed before the failure are kept, the one in flight is dropped.
        """
        current: _Incoming | None = None
        done: pb.FetchDone | None = None
        self.first = None
        self.kind = SLICE_DIGEST_ALGORITHM
        try:
            for item in stream:
                if isinstance(item, bytes):
                    response = parse_fetch_response(item)
                else:
                    response = from_message(item)
                if self.first is None:
                    self.first = response
                    self.kind = self._stream_kind(response.slice_digest)
                    self._check_vocab_pad(response.vocab_pad)
                    check_version(self.version, response.version)
                if done is not None:
                    raise DataLossError("the daemon sent data after closing the stream")
                if response.model_fingerprint:
                    self.fingerprint = response.model_fingerprint
                for chunk in response.chunks:
                    current = self._chunk(chunk, current)
                if response.done is not None:
                    done = response.done
        except grpc.RpcError as exc:
            if current is not None:
                self.discarded_bytes += current.received
            raise from_rpc_error(exc) from None
        except WeightdError:
            stream.cancel()
            raise
        if done is None:
            raise DataLossError("the stream ended before the daemon marked it complete")
        if current is not None or done.num_tensors != len(self.tensors):
            raise DataLossError(
                f"the daemon announced {done.num_tensors} tensors; "
                f"{len(self.tensors)} arrived complete"
            )

    def _stream_kind(self, named: str) -> str:
        """The digest kind of a stream whose first message names ``named``.

        Unset is SHA-256 (a daemon that predates the field, or a request that did not
        ask). A daemon may only name the kind that was asked for.
        """
        if not named:
            return SLICE_DIGEST_ALGORITHM
        if named not in (self.asked, SLICE_DIGEST_ALGORITHM):
            raise DataLossError(
                f"the daemon names slice digests {named[:64]!r}; the client asked for "
                f"{self.asked or SLICE_DIGEST_ALGORITHM!r}"
            )
        return named

    def _check_vocab_pad(self, named: int) -> None:
        """Refuse a stream whose vocabulary cut is not the one asked for.

        A daemon that predates ``Layout.vocab_pad`` ignores it, cuts equal blocks and
        names nothing: refused before any tensor arrives (the stream is cancelled), as
        :class:`VocabPadUnsupportedError`. A daemon naming another value is not to be
        believed about anything else either.
        """
        if named == self.vocab_pad:
            return
        if not named:
            raise VocabPadUnsupportedError(
                f"the daemon predates Layout.vocab_pad: asked for vocab_pad {self.vocab_pad}, "
                "it would cut vocabulary-parallel tensors in equal blocks; fetch with "
                "vocab_pad 0 (and re-cut), or upgrade the daemon"
            )
        raise DataLossError(
            f"the daemon names vocab_pad {named}; the client asked for {self.vocab_pad}"
        )

    def _chunk(self, chunk: WireChunk, current: _Incoming | None) -> _Incoming | None:
        """Apply one chunk; the tensor still in flight afterwards (None: none)."""
        if chunk.index != self.next_index:
            raise DataLossError(
                f"chunk for tensor {chunk.index} arrived while tensor {self.next_index} was due"
            )
        if chunk.header is not None:
            if current is not None:
                raise DataLossError(
                    f"tensor header {chunk.index} arrived before {current.name!r} was complete"
                )
            current = _Incoming(chunk.header, self.into.get(chunk.header.name), self.kind)
        elif current is None:
            raise DataLossError(f"chunk for tensor {chunk.index} arrived before its header")
        current.write(chunk)
        self.received_bytes += chunk.data.nbytes
        if not chunk.digest:
            return current
        if current.name in self.tensors:
            raise DataLossError(f"tensor {current.name!r} was sent twice")
        try:
            self.tensors[current.name] = current.finish(chunk.digest)
        except DigestMismatchError:
            self.discarded_bytes += current.received  # asked for again (a recheck)
            raise
        if self.on_tensor is not None:
            self.on_tensor(chunk.index, current.name)
        return None


def check_version(asked: int, named: int) -> None:
    """Refuse a stream (or pack) of another model version than the one asked for.

    A daemon that predates versions serves the current one and names none: refused
    (FAILED_PRECONDITION), since it may not be the one asked for.
    """
    if not asked or named == asked:
        return
    if not named:
        raise FailedPreconditionError(
            f"the daemon predates model versions: asked for version {asked}, it would "
            "send whatever it serves now; upgrade the daemon"
        )
    raise DataLossError(f"the daemon sent model version {named}; the client asked for {asked}")


def receive_all(stream: Any, first: list[WireResponse] | None = None) -> dict[str, torch.Tensor]:
    """Every slice of one Fetch-format stream, digest-checked; never a partial result.

    ``first``, when given (empty), receives the stream's first message (FetchAdapter
    names the adapter version there).
    """
    receiver = RankReceiver()
    receiver.consume(stream)
    if first is not None and receiver.first is not None:
        first.append(receiver.first)
    return dict(receiver.tensors)


def total_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
