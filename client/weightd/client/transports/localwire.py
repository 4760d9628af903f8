"""The side channel's messages a shared-memory fetch uses, in protobuf's wire format by hand.

Why not the generated classes: a worker's first same-host fetch is what a fresh
process pays before it has its weights, and importing the generated ``local_pb2``
(which pulls ``weightd_pb2`` and builds both descriptor pools) cost a fresh worker
more than the whole fetch (mapping a sealed pack and viewing its tensors; measured in
the vLLM load note in docs/notes). This
module encodes the one request a fetch sends (``LocalRequest`` with ``AcquirePack`` or
``AttachPack``) and decodes the two answers it reads (``LocalHello``,
``LocalResponse`` with a ``PackGrant`` or a ``LocalError``) with the standard library
alone; everything else (stats, CUDA IPC grants, an adapter's ``AdapterInfo``) is
parsed by the generated classes from the same bytes (:attr:`Grant.raw`), imported
only then. The field numbers are ``proto/weightd/v1/local.proto``'s; a test
round-trips every field through the generated classes both ways.

Unknown fields are skipped (a newer daemon may add some), as protobuf does; a
malformed message raises :class:`WireError`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from ..base.layout import Layout
from ..base.request import Wanted

PLACEMENT_HOST: Final = 1
PLACEMENT_CUDA: Final = 2
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    """A side-channel message that is not what protobuf would have written."""


# --- encoding ------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(number: int, kind: int) -> bytes:
    return _varint(number << 3 | kind)


def _uint(number: int, value: int) -> bytes:
    return _key(number, _VARINT) + _varint(value) if value else b""


def _bytes(number: int, value: bytes) -> bytes:
    return _key(number, _LEN) + _varint(len(value)) + value


def _text(number: int, value: str) -> bytes:
    return _bytes(number, value.encode()) if value else b""


def _layout(layout: Layout) -> bytes:
    """``weightd.v1.Layout`` (numbers as in weightd.proto)."""
    packed = b"".join(_varint(n) for n in layout.pp_layers)
    return b"".join(
        (
            _uint(1, layout.tp_size),
            _uint(2, layout.tp_rank),
            _uint(3, layout.pp_size),
            _uint(4, layout.pp_rank),
            _uint(5, layout.ep_size),
            _uint(6, layout.ep_rank),
            _bytes(7, packed) if packed else b"",
            _uint(8, layout.vocab_pad),
        )
    )


def encode_acquire(
    wanted: Wanted,
    *,
    placement: int = PLACEMENT_HOST,
    gpu_uuid: str = "",
    slice_digests: Sequence[str] = (),
    no_wait: bool = False,
) -> bytes:
    """A ``LocalRequest`` holding one ``AcquirePack`` for ``wanted``: ``placement`` and
    ``gpu_uuid`` say where the pack goes, ``slice_digests`` the digest kinds this client
    can check, ``no_wait`` that a pack still being built is refused at once."""
    body = b"".join(
        (
            _text(1, wanted.model),
            _bytes(2, _layout(wanted.layout)),
            *(_bytes(3, n.encode()) for n in wanted.names),
            _uint(4, placement),
            _text(5, gpu_uuid),
            _text(6, wanted.adapter),
            *(_bytes(7, k.encode()) for k in slice_digests),
            _uint(8, int(no_wait)),
            _uint(9, wanted.version),
        )
    )
    return _bytes(1, body)


def encode_attach(
    *, boot_id: str, pack_id: int, names: Sequence[str] = (), slice_digests: Sequence[str] = ()
) -> bytes:
    """A ``LocalRequest`` holding one ``AttachPack``."""
    body = b"".join(
        (
            _text(1, boot_id),
            _uint(2, pack_id),
            *(_bytes(3, n.encode()) for n in names),
            *(_bytes(4, k.encode()) for k in slice_digests),
        )
    )
    return _bytes(2, body)


# --- decoding ------------------------------------------------------------------------


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result & ((1 << 64) - 1), pos
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(number, wire type, value)`` of every field: ints for varints and fixed
    numbers, bytes for length-delimited ones."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if kind == _VARINT:
            value, pos = _read_varint(data, pos)
            yield number, kind, value
        elif kind == _LEN:
            n, pos = _read_varint(data, pos)
            if pos + n > len(data):
                raise WireError("a field runs past the message")
            yield number, kind, data[pos : pos + n]
            pos += n
        elif kind == _I64:
            if pos + 8 > len(data):
                raise WireError("truncated fixed64")
            yield number, kind, struct.unpack_from("<Q", data, pos)[0]
            pos += 8
        elif kind == _I32:
            if pos + 4 > len(data):
                raise WireError("truncated fixed32")
            yield number, kind, struct.unpack_from("<I", data, pos)[0]
            pos += 4
        else:
            raise WireError(f"wire type {kind} is not one protobuf writes")


def _str(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise WireError("a string field is not length-delimited")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise WireError("a string field is not UTF-8") from None


def _int(value: int | bytes) -> int:
    if isinstance(value, bytes):
        raise WireError("a number field is length-delimited")
    return value


def _raw(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise WireError("a message field is not length-delimited")
    return value


def _flag(value: int | bytes) -> bool:
    return bool(_int(value))


#: How a message's fields are read: number -> (attribute, convert, repeated).
Table = dict[int, tuple[str, Callable[[int | bytes], Any], bool]]


def _fill(obj: Any, data: bytes, table: Table) -> Any:
    """Set ``obj``'s attributes from ``data``'s fields as ``table`` says (unknown: skipped).

    A repeated number field accepts the packed form (one length-delimited field) and
    one element per field, as protobuf readers must.
    """
    for number, kind, value in fields(data):
        spec = table.get(number)
        if spec is None:
            continue
        name, convert, repeated = spec
        if not repeated:
            setattr(obj, name, convert(value))
        elif convert is _int and kind == _LEN:
            assert isinstance(value, bytes)
            pos = 0
            while pos < len(value):
                n, pos = _read_varint(value, pos)
                getattr(obj, name).append(n)
        else:
            getattr(obj, name).append(convert(value))
    return obj


class Error:
    """``LocalError``: the status, and the daemon's error class and fields (``reason``,
    ``metadata``, as gRPC's ``ErrorInfo`` carries them; empty from older daemons)."""

    __slots__ = ("code", "detail", "metadata", "pending", "reason", "transport")

    def __init__(self) -> None:
        self.code = 0
        self.detail = ""
        self.transport = False
        self.reason = ""
        self.metadata: dict[str, str] = {}
        self.pending = False


class _MapEntry:
    """One ``map<string, string>`` entry (a message with key 1 and value 2)."""

    __slots__ = ("key", "value")

    def __init__(self) -> None:
        self.key = ""
        self.value = ""


_MAP_ENTRY: Table = {1: ("key", _str, False), 2: ("value", _str, False)}


def _map_entry(value: int | bytes) -> _MapEntry:
    out: _MapEntry = _fill(_MapEntry(), _raw(value), _MAP_ENTRY)
    return out


_ERROR: Table = {
    1: ("code", _int, False),
    2: ("detail", _str, False),
    3: ("transport", _flag, False),
    4: ("reason", _str, False),
    5: ("entries", _map_entry, True),
    6: ("pending", _flag, False),
}


class _ErrorFields(Error):
    __slots__ = ("entries",)

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[_MapEntry] = []


def decode_error(data: bytes) -> Error:
    raw: _ErrorFields = _fill(_ErrorFields(), data, _ERROR)
    out = Error()
    out.code, out.detail, out.transport = raw.code, raw.detail, raw.transport
    out.reason, out.pending = raw.reason, raw.pending
    out.metadata = {e.key: e.value for e in raw.entries}  # the last of a key wins, as in protobuf
    return out


class Hello:
    """``LocalHello``."""

    __slots__ = ("boot_id", "gpu_uuids", "pid", "placements", "protocol_version", "refused")

    def __init__(self) -> None:
        self.protocol_version = 0
        self.boot_id = ""
        self.placements: list[int] = []
        self.gpu_uuids: list[str] = []
        self.pid = 0
        self.refused: Error | None = None


_HELLO: Table = {
    1: ("protocol_version", _int, False),
    2: ("boot_id", _str, False),
    3: ("placements", _int, True),
    4: ("gpu_uuids", _str, True),
    5: ("pid", _int, False),
    6: ("refused", lambda v: decode_error(_raw(v)), False),
}


def decode_hello(data: bytes) -> Hello:
    out: Hello = _fill(Hello(), data, _HELLO)
    return out


class Entry:
    """``PackEntry``: one tensor slice in a pack."""

    __slots__ = ("digest", "dtype", "name", "nbytes", "offset", "replicated", "shape", "split_dim")

    def __init__(self) -> None:
        self.name = ""
        self.dtype = ""
        self.shape: list[int] = []
        self.offset = 0
        self.nbytes = 0
        self.digest = ""
        self.split_dim = 0
        self.replicated = False


_ENTRY: Table = {
    1: ("name", _str, False),
    2: ("dtype", _str, False),
    3: ("shape", _int, True),
    4: ("offset", _int, False),
    5: ("nbytes", _int, False),
    6: ("digest", _str, False),
    7: ("split_dim", _int, False),
    8: ("replicated", _flag, False),
}


class _Layout:
    """``weightd.v1.Layout``'s fields as read, before they become a :class:`Layout`."""

    def __init__(self) -> None:
        self.tp_size = self.tp_rank = self.pp_size = self.pp_rank = 0
        self.ep_size = self.ep_rank = self.vocab_pad = 0
        self.pp_layers: list[int] = []


_LAYOUT: Table = {
    **{
        n: (name, _int, False)
        for n, name in enumerate(
            ("tp_size", "tp_rank", "pp_size", "pp_rank", "ep_size", "ep_rank"), start=1
        )
    },
    7: ("pp_layers", _int, True),
    8: ("vocab_pad", _int, False),
}


def _decode_layout(data: bytes) -> Layout:
    got = _fill(_Layout(), data, _LAYOUT)
    return Layout.of_proto(got)  # reads the same field names as the message's


class Grant:
    """``PackGrant``, as a shared-memory fetch reads it; ``raw`` is its wire bytes."""

    __slots__ = (
        "adapter",
        "boot_id",
        "built",
        "cuda_ipc_handle",
        "entries",
        "gpu_uuid",
        "huge_pages",
        "layout",
        "model",
        "pack_id",
        "pinned",
        "placement",
        "raw",
        "size_bytes",
        "version",
    )

    def __init__(self, raw: bytes = b"") -> None:
        self.raw = raw
        self.boot_id = ""
        self.pack_id = 0
        self.model = ""
        self.layout = Layout()
        self.placement = 0
        self.size_bytes = 0
        self.entries: list[Entry] = []
        self.cuda_ipc_handle = b""
        self.gpu_uuid = ""
        self.pinned = False
        self.built = False
        #: The ``AdapterInfo`` message's bytes for an adapter pack (None: a model's pack).
        self.adapter: bytes | None = None
        self.huge_pages = False
        #: The model version the pack holds (0 from a daemon that predates versions).
        self.version = 0


_GRANT: Table = {
    1: ("boot_id", _str, False),
    2: ("pack_id", _int, False),
    3: ("model", _str, False),
    4: ("layout", lambda v: _decode_layout(_raw(v)), False),
    5: ("placement", _int, False),
    6: ("size_bytes", _int, False),
    7: ("entries", lambda v: _fill(Entry(), _raw(v), _ENTRY), True),
    8: ("cuda_ipc_handle", _raw, False),
    9: ("gpu_uuid", _str, False),
    10: ("pinned", _flag, False),
    11: ("built", _flag, False),
    12: ("adapter", _raw, False),
    13: ("huge_pages", _flag, False),
    14: ("version", _int, False),
}


def decode_grant(data: bytes) -> Grant:
    g: Grant = _fill(Grant(data), data, _GRANT)
    return g


class Response:
    """``LocalResponse``: one of a grant, an error, or (``stats``, ``description``) the
    bytes of the stats or of a ``ModelDescription`` (``local_describe`` reads those)."""

    __slots__ = ("description", "error", "grant", "stats")

    def __init__(
        self,
        grant: Grant | None = None,
        error: Error | None = None,
        stats: bytes | None = None,
        description: bytes | None = None,
    ) -> None:
        self.grant = grant
        self.error = error
        self.stats = stats
        self.description = description


def decode_response(data: bytes) -> Response:
    out = Response()
    for number, _, value in fields(data):
        if number == 1:
            out = Response(grant=decode_grant(_raw(value)))
        elif number == 2:
            out = Response(stats=_raw(value))
        elif number == 3:
            out = Response(error=decode_error(_raw(value)))
        elif number == 10:
            out = Response(description=_raw(value))
    return out
