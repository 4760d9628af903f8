"""``FetchResponse`` messages written in protobuf wire format by hand, for the Fetch stream.

Why by hand: with the generated code, each tensor byte the daemon streams was copied
three times inside protobuf before gRPC saw it: into the ``TensorChunk`` (upb copies a
``bytes`` field into its arena), again into the ``FetchResponse`` (building it with
``chunks=[...]`` deep-copies each chunk), and a third time by ``SerializeToString``.
Measured with ``bench/grpc_throughput.py`` (2 cores, Unix socket, 1 MiB messages): a
bare server that only builds and serialises such messages spends ~1.9 s of CPU per GB,
against ~0.5 s for the same bytes sent raw; in the daemon, writing the messages here
instead cut its CPU per GB from ~2.0 s to ~1.3 s (SHA-256 is ~0.6 s of what is left).
On a host where the daemon and its clients share the cores, that time came straight
out of the clients' throughput.

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

from typing import Final, TypeAlias

from weightd.v1 import weightd_pb2 as pb

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


#: Anything whose bytes can be joined: ``bytes`` from ``pread``, or a read buffer.
Buffer: TypeAlias = bytes | bytearray | memoryview

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

    __slots__ = ("_done", "_fingerprint", "_parts", "payload_bytes")

    def __init__(self) -> None:
        self._parts: list[Buffer] = []
        self._done = b""
        self._fingerprint = b""
        self.payload_bytes = 0

    def add_chunk(
        self,
        index: int,
        offset: int,
        data: Buffer,
        *,
        header: pb.SliceHeader | None = None,
        digest: str = "",
    ) -> None:
        """Append a ``TensorChunk``; ``header`` None leaves the field unset (not empty).

        ``data`` is referenced, not copied: it must not change until :meth:`serialize`.
        """
        if not 0 <= index <= _UINT32_MAX:
            raise ValueError(f"chunk index {index} does not fit a uint32")
        size = memoryview(data).nbytes
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
        return not self._parts

    def serialize(self) -> bytes:
        """The message's wire bytes: the payload is copied here, once."""
        return b"".join([*self._parts, self._done, self._fingerprint])


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
