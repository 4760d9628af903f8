"""Reading ``FetchResponse`` wire bytes without protobuf's copies of the tensor payload.

Why: parsed with the generated code, each tensor byte received was copied twice
inside protobuf (``FromString`` copies a ``bytes`` field into the message's arena, and
reading ``chunk.data`` copies it out again into a new ``bytes``) before the one copy
that matters, into the tensor. Those copies are of data still in cache, so they cost
less than the copy into fresh tensor memory, but measured with
``bench/grpc_throughput.py`` this parser cut the client's CPU per byte noticeably; what
is left is mostly page faults of the fresh tensors and the digest check (figures: the
gRPC notebook in ``docs/notes/``). It also turns a malformed message into ``DataLossError``;
a failing response deserializer inside gRPC would have become an INTERNAL status.

:func:`parse_fetch_response` reads the message as gRPC hands it over (``bytes``) and
returns each chunk's ``data`` as a ``memoryview`` into that message: the receiver
copies it straight into the tensor and hashes it in place. Small sub-messages (slice
headers, ``done``, ``adapter``) are still parsed by protobuf.

Only the shape the daemon writes is read by hand: each known field at most once, with
its declared wire type, every length in bounds. Anything else (unknown or repeated
fields, out-of-range integers, invalid UTF-8, truncation) is handed to protobuf itself,
so whatever protobuf accepts is read exactly as protobuf reads it, and whatever it
rejects raises :class:`~weightd.client.base.errors.DataLossError`.
"""

from __future__ import annotations

from typing import Final, TypeVar

import grpc
from google.protobuf.message import DecodeError

from weightd.v1 import weightd_pb2 as pb

from ..base.errors import DataLossError

#: The Fetch method's full name, for a raw-bytes call of it.
FETCH_METHOD: Final = "/weightd.v1.Weights/Fetch"

_UINT32_MAX: Final = (1 << 32) - 1
_UINT64_MAX: Final = (1 << 64) - 1
_VARINT: Final = 0
_LEN: Final = 2

M = TypeVar("M", pb.FetchDone, pb.AdapterInfo, pb.SliceHeader)


class _Unusual(Exception):
    """The fast path stops here; protobuf decides (and reads it exactly as before)."""


class WireChunk:
    """One ``TensorChunk``; ``data`` views the received message, it is not a copy."""

    __slots__ = ("data", "digest", "header", "index", "offset")

    def __init__(
        self,
        index: int,
        header: pb.SliceHeader | None,
        offset: int,
        data: memoryview,
        digest: str,
    ) -> None:
        self.index = index
        self.header = header  # None: the field was not set
        self.offset = offset
        self.data = data
        self.digest = digest


class WireResponse:
    """One ``FetchResponse``: its chunks, and the fields set only on some messages."""

    __slots__ = (
        "adapter",
        "chunks",
        "done",
        "model_fingerprint",
        "slice_digest",
        "version",
        "vocab_pad",
    )

    def __init__(
        self,
        chunks: list[WireChunk],
        done: pb.FetchDone | None = None,
        adapter: pb.AdapterInfo | None = None,
        model_fingerprint: str = "",
        slice_digest: str = "",
        vocab_pad: int = 0,
        version: int = 0,
    ) -> None:
        self.chunks = chunks
        self.done = done  # None: not set
        self.adapter = adapter  # None: not set
        self.model_fingerprint = model_fingerprint
        self.slice_digest = slice_digest  # "": not set (SHA-256)
        self.vocab_pad = vocab_pad  # 0: not set (equal blocks, or a daemon before the field)
        self.version = version  # 0: not set (a daemon before model versions)


class RawFetchStub:
    """``Weights.Fetch`` called with no response deserializer: messages stay wire bytes.

    Same request, same method, same wire bytes as the generated stub; the receiver
    parses them with :func:`parse_fetch_response`. A parse failure then surfaces as
    :class:`DataLossError` from the receiver (a failing deserializer would have become
    an INTERNAL status inside gRPC).
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self.Fetch: grpc.UnaryStreamMultiCallable[pb.FetchRequest, bytes] = channel.unary_stream(
            FETCH_METHOD, request_serializer=pb.FetchRequest.SerializeToString
        )


def from_message(msg: pb.FetchResponse) -> WireResponse:
    """The same view of a message protobuf parsed (generated stubs, FetchAdapter)."""
    return WireResponse(
        [
            WireChunk(
                c.index,
                c.header if c.HasField("header") else None,
                c.offset,
                memoryview(c.data),
                c.digest,
            )
            for c in msg.chunks
        ],
        msg.done if msg.HasField("done") else None,
        msg.adapter if msg.HasField("adapter") else None,
        msg.model_fingerprint,
        msg.slice_digest,
        msg.vocab_pad,
        msg.version,
    )


def parse_fetch_response(raw: bytes) -> WireResponse:
    """Parse one ``FetchResponse`` from its wire bytes; payloads stay views of ``raw``.

    Raises :class:`DataLossError` when protobuf would reject the bytes.
    """
    try:
        return _parse(raw)
    except _Unusual:
        pass
    try:
        msg = pb.FetchResponse.FromString(raw)
    except DecodeError as exc:
        raise DataLossError(f"the daemon sent a malformed FetchResponse: {exc}") from None
    return from_message(msg)


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    if pos >= end:
        raise _Unusual
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    value = b & 0x7F
    shift = 7
    pos += 1
    while True:
        if pos >= end or shift > 63:
            raise _Unusual
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            if value > _UINT64_MAX:
                raise _Unusual
            return value, pos
        shift += 7


def _field(buf: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(field number, wire type, position after the key)."""
    key, pos = _varint(buf, pos, end)
    return key >> 3, key & 7, pos


def _span(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """A length-delimited field's bounds (start, stop) after its key."""
    size, start = _varint(buf, pos, end)
    stop = start + size
    if stop > end:
        raise _Unusual
    return start, stop


def _text(buf: bytes, start: int, stop: int) -> str:
    try:
        return buf[start:stop].decode()
    except UnicodeDecodeError:
        raise _Unusual from None


def _parse(raw: bytes) -> WireResponse:
    view = memoryview(raw)
    end = len(raw)
    pos = 0
    chunks: list[WireChunk] = []
    done: pb.FetchDone | None = None
    adapter: pb.AdapterInfo | None = None
    fingerprint: str | None = None
    kind: str | None = None
    vocab_pad: int | None = None
    version: int | None = None
    while pos < end:
        number, wire, pos = _field(raw, pos, end)
        if number == 6 and wire == _VARINT and vocab_pad is None:
            vocab_pad, pos = _varint(raw, pos, end)
            if vocab_pad > _UINT32_MAX:
                raise _Unusual  # protobuf truncates an oversized uint32: let it decide
            continue
        if number == 7 and wire == _VARINT and version is None:
            version, pos = _varint(raw, pos, end)
            continue
        if wire != _LEN:
            raise _Unusual
        start, pos = _span(raw, pos, end)
        if number == 1:
            chunks.append(_chunk(raw, view, start, pos))
        elif number == 2 and done is None:
            done = _sub(pb.FetchDone, raw, start, pos)
        elif number == 3 and adapter is None:
            adapter = _sub(pb.AdapterInfo, raw, start, pos)
        elif number == 4 and fingerprint is None:
            fingerprint = _text(raw, start, pos)
        elif number == 5 and kind is None:
            kind = _text(raw, start, pos)
        else:
            raise _Unusual  # unknown, or set twice (protobuf merges): let it decide
    return WireResponse(
        chunks, done, adapter, fingerprint or "", kind or "", vocab_pad or 0, version or 0
    )


def _sub(cls: type[M], raw: bytes, start: int, stop: int) -> M:
    try:
        return cls.FromString(raw[start:stop])
    except DecodeError:
        raise _Unusual from None


def _chunk(raw: bytes, view: memoryview, pos: int, end: int) -> WireChunk:
    index = offset = 0
    header: pb.SliceHeader | None = None
    data = view[0:0]
    digest = ""
    seen = 0
    while pos < end:
        number, wire, pos = _field(raw, pos, end)
        bit = 1 << number if 1 <= number <= 5 else 0
        if not bit or seen & bit:
            raise _Unusual  # unknown, or repeated (last-wins / merge): let protobuf decide
        seen |= bit
        if number in (1, 3):
            if wire != _VARINT:
                raise _Unusual
            value, pos = _varint(raw, pos, end)
            if number == 1:
                if value > _UINT32_MAX:
                    raise _Unusual
                index = value
            else:
                offset = value
            continue
        if wire != _LEN:
            raise _Unusual
        start, pos = _span(raw, pos, end)
        if number == 2:
            header = _sub(pb.SliceHeader, raw, start, pos)
        elif number == 4:
            data = view[start:pos]
        else:
            digest = _text(raw, start, pos)
    return WireChunk(index, header, offset, data, digest)
