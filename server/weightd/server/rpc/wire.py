"""``FetchResponse`` messages written in protobuf wire format by hand, for the Fetch stream.

Why by hand: with the generated code, each tensor byte the daemon streams was copied
three times inside protobuf before gRPC saw it: into the ``TensorChunk`` (upb copies a
``bytes`` field into its arena), again into the ``FetchResponse`` (building it with
``chunks=[...]`` deep-copies each chunk), and a third time by ``SerializeToString``.
Measured with ``bench/grpc_throughput.py``, building messages that way cost several
times the CPU per byte of sending the same bytes raw, and writing them here instead cut
the daemon's CPU per byte by about a third (figures: the dated gRPC notebook in
``docs/notes/``). On a host where the daemon and its clients share the cores, that
time comes straight out of the clients' throughput.

:class:`EncodedResponse` keeps a message as the list of its wire pieces (small
prefixes, and the tensor bytes as read from the shard, not copied) and joins them once,
in :func:`serialize_fetch_response`, the Fetch method's response serializer: one copy,
into the ``bytes`` object gRPC's Python API requires.

The bytes are exactly those ``SerializeToString`` writes for the same message: fields
in field-number order, proto3 defaults (0, empty) left out, a set sub-message always
written even when empty (``header``, ``done``). The unit tests compare the two byte for
byte, so old and new clients parse the stream exactly as before. Only ``Fetch`` uses
this; every other method (FetchAdapter included) still goes through protobuf.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final, TypeAlias

from weightd.v1 import weightd_pb2 as pb

from ..weights.layouts import TensorSlice

#: The services' full names, from the proto itself (health statuses, routing, guards).
WEIGHTS_SERVICE: Final = pb.DESCRIPTOR.services_by_name["Weights"].full_name
ADMIN_SERVICE: Final = pb.DESCRIPTOR.services_by_name["Admin"].full_name

#: Payload bytes per message of a Fetch or FetchAdapter stream. 1 MiB was fastest here
#: (PERFORMANCE.md); past 4 MiB a message meets gRPC's default receive limit.
DEFAULT_CHUNK_BYTES: Final = 1 << 20
MAX_CHUNK_BYTES: Final = 4 << 20
MIN_CHUNK_BYTES: Final = 4 << 10


def chunk_bytes(requested: int, default: int = DEFAULT_CHUNK_BYTES) -> int:
    """The payload bytes per message a stream uses: the request's (0: ``default``), clamped."""
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, requested or default))


def slice_header(s: TensorSlice) -> pb.SliceHeader:
    """The header a slice's first chunk carries, on a Fetch and a FetchAdapter stream."""
    header = pb.SliceHeader(name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes)
    header.split_dim, header.replicated = s.split_dim, s.replicated
    return header


#: Anything whose bytes can be joined: ``bytes`` from ``pread``, or a read buffer.
Buffer: TypeAlias = bytes | bytearray | memoryview
#: Writes a chunk's payload into the message, in place (the view is exactly its size):
#: the Fetch stream reads the shard straight into it and checks the slice's digest.
Fill: TypeAlias = Callable[[memoryview], None]


class _Deferred:
    """A payload not read yet: ``size`` bytes that ``fill`` writes when the message is built."""

    __slots__ = ("fill", "size")

    def __init__(self, size: int, fill: Fill) -> None:
        self.size = size
        self.fill = fill


def _bytes_api() -> tuple[Callable[[None, int], bytes], Callable[[bytes], int]] | None:
    """CPython's ``PyBytes_FromStringAndSize`` and ``PyBytes_AsString``, or None elsewhere."""
    try:
        api = ctypes.pythonapi
    except AttributeError:  # not CPython
        return None
    new = api.PyBytes_FromStringAndSize
    new.restype = ctypes.py_object
    new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    address = api.PyBytes_AsString
    address.restype = ctypes.c_void_p
    address.argtypes = (ctypes.py_object,)
    return new, address


_BYTES_API: Final = _bytes_api()


def writable_bytes(size: int) -> tuple[bytes, memoryview | None]:
    """A new ``bytes`` of ``size`` bytes and a writable view of its memory (None: unavailable).

    Why: gRPC's Python API takes each message as one ``bytes``, and a ``bytes`` can
    only be filled while it is being created. ``PyBytes_FromStringAndSize(NULL, n)``
    is how C code does that: the object is allocated with its contents uninitialised,
    for its creator to fill before anyone else sees it. Doing the same here lets the
    daemon read a shard straight into the message it sends, instead of reading into
    one buffer and joining it into the message (one copy of every byte fewer; measured
    in the gRPC notebook under ``docs/notes/``). The caller must fill every byte, keep the view to
    itself, release it before handing the ``bytes`` out, and never use it after.
    Sizes 0 and 1 are shared singletons in CPython, so they are refused (None).
    """
    if _BYTES_API is None or size < 2:
        return b"", None
    new, address = _BYTES_API
    out = new(None, size)
    view = memoryview((ctypes.c_char * size).from_address(address(out))).cast("B")
    return out, view


# Field keys: (field number << 3) | wire type (0 varint, 2 length-delimited).
_RESPONSE_CHUNKS: Final = b"\x0a"  # FetchResponse.chunks = 1
_RESPONSE_DONE: Final = b"\x12"  # FetchResponse.done = 2
_RESPONSE_FINGERPRINT: Final = b"\x22"  # FetchResponse.model_fingerprint = 4
_CHUNK_INDEX: Final = b"\x08"  # TensorChunk.index = 1
_CHUNK_HEADER: Final = b"\x12"  # TensorChunk.header = 2
_CHUNK_OFFSET: Final = b"\x18"  # TensorChunk.offset = 3
_CHUNK_DATA: Final = b"\x22"  # TensorChunk.data = 4
_CHUNK_DIGEST: Final = b"\x2a"  # TensorChunk.digest = 5

_UINT32_MAX: Final = (1 << 32) - 1
_UINT64_MAX: Final = (1 << 64) - 1


def varint(value: int) -> bytes:
    """``value`` (0 ≤ value < 2**64) as a protobuf base-128 varint (pure)."""
    if not 0 <= value <= _UINT64_MAX:
        raise ValueError(f"{value} does not fit a uint64 varint")
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(key: bytes, body: bytes) -> bytes:
    return key + varint(len(body)) + body


class EncodedResponse:
    """One ``FetchResponse``, kept as the pieces of its wire bytes until it is sent.

    Add the chunks in stream order, then at most one ``done`` and a fingerprint;
    :meth:`serialize` joins everything. ``payload_bytes`` counts the tensor bytes
    (``TensorChunk.data``) it carries, for the daemon's metrics.
    """

    __slots__ = ("_built", "_done", "_fingerprint", "_parts", "payload_bytes")

    def __init__(self) -> None:
        self._parts: list[Buffer | _Deferred] = []
        self._done = b""
        self._fingerprint = b""
        self._built: bytes | None = None
        self.payload_bytes = 0

    def add_chunk(
        self,
        index: int,
        offset: int,
        data: Buffer | _Deferred,
        *,
        header: pb.SliceHeader | None = None,
        digest: str = "",
    ) -> None:
        """Append a ``TensorChunk``; ``header`` None leaves the field unset (not empty).

        ``data`` is referenced, not copied: it must not change until :meth:`serialize`.
        It may be a :class:`_Deferred` payload (see :meth:`add_chunk_into`).
        """
        if not 0 <= index <= _UINT32_MAX:
            raise ValueError(f"chunk index {index} does not fit a uint32")
        size = data.size if isinstance(data, _Deferred) else memoryview(data).nbytes
        before = b""
        if index:
            before += _CHUNK_INDEX + varint(index)
        if header is not None:
            before += _length_delimited(_CHUNK_HEADER, header.SerializeToString())
        if offset:
            before += _CHUNK_OFFSET + varint(offset)
        if size:
            before += _CHUNK_DATA + varint(size)
        after = _length_delimited(_CHUNK_DIGEST, digest.encode()) if digest else b""
        body = len(before) + size + len(after)
        self._parts.append(_RESPONSE_CHUNKS + varint(body) + before)
        if size:
            self._parts.append(data)
        if after:
            self._parts.append(after)
        self.payload_bytes += size

    def add_chunk_into(
        self,
        index: int,
        offset: int,
        size: int,
        fill: Fill,
        *,
        header: pb.SliceHeader | None = None,
        digest: str = "",
    ) -> None:
        """Append a ``TensorChunk`` whose ``size`` payload bytes ``fill`` writes in :meth:`build`.

        ``digest`` is written as given; a ``fill`` that checks it raises from
        :meth:`build`, before the message exists.
        """
        self.add_chunk(index, offset, _Deferred(size, fill), header=header, digest=digest)

    def build(self) -> bytes:
        """The message's bytes, written now: every deferred payload is filled in place.

        Once per message, after its last chunk and ``done``. Errors from a ``fill``
        propagate (the message is then never sent). Where :func:`writable_bytes` is
        not available, payloads are filled into buffers and joined (one copy more).
        """
        if self._built is not None:
            return self._built
        parts = [*self._parts, self._done, self._fingerprint]
        if not any(isinstance(p, _Deferred) for p in parts):
            self._built = b"".join(p for p in parts if not isinstance(p, _Deferred))
            self._parts = []
            return self._built
        total = sum(p.size if isinstance(p, _Deferred) else memoryview(p).nbytes for p in parts)
        out, view = writable_bytes(total)
        if view is None:
            pieces: list[Buffer] = []
            for p in parts:
                if isinstance(p, _Deferred):
                    buf = bytearray(p.size)
                    p.fill(memoryview(buf))
                    pieces.append(buf)
                else:
                    pieces.append(p)
            self._built = b"".join(pieces)
            self._parts = []
            return self._built
        with view:
            pos = 0
            for p in parts:
                if isinstance(p, _Deferred):
                    p.fill(view[pos : pos + p.size])
                    pos += p.size
                else:
                    n = memoryview(p).nbytes
                    view[pos : pos + n] = p
                    pos += n
        # Only now, with every byte written: a failed build leaves nothing to send.
        self._built = out
        self._parts = []  # the payload buffers are not needed any more
        return out

    def set_done(self, done: pb.FetchDone) -> None:
        """Set ``FetchResponse.done`` (written even when all its fields are 0)."""
        self._done = _length_delimited(_RESPONSE_DONE, done.SerializeToString())

    def set_fingerprint(self, fingerprint: str) -> None:
        """Set ``FetchResponse.model_fingerprint``."""
        raw = fingerprint.encode()
        self._fingerprint = _length_delimited(_RESPONSE_FINGERPRINT, raw) if raw else b""

    @property
    def empty(self) -> bool:
        """True while no chunk was added."""
        return not self._parts and self._built is None

    def serialize(self) -> bytes:
        """The message's wire bytes (built now unless :meth:`build` ran)."""
        return self.build()


def serialize_fetch_response(response: pb.FetchResponse | EncodedResponse) -> bytes:
    """The Fetch method's response serializer: hand-encoded or generated messages alike."""
    if isinstance(response, EncodedResponse):
        return response.serialize()
    return response.SerializeToString()


def payload_bytes(response: object) -> int:
    """Tensor bytes a Fetch-format response carries (0 for anything else)."""
    if isinstance(response, EncodedResponse):
        return response.payload_bytes
    if isinstance(response, pb.FetchResponse):
        return sum(len(c.data) for c in response.chunks)
    return 0
