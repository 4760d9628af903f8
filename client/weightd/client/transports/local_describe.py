"""Describing a model over the side socket: the first step of a same-host conversation.

A worker on the daemon's host (the vLLM loader) describes the model, proves its local
copy is that checkpoint, then maps its rank's pack. Describing over gRPC opened a
channel (an HTTP/2 connection, gRPC's threads) for one small answer a plain file
read never needs; here it is one exchange on the side socket the fetch uses anyway
(``LocalRequest.describe``, field 10), answered with the gRPC ``DescribeModel``'s own
message by the daemon's same code. As in :mod:`.localwire`, the request is encoded
and the answer decoded with the standard library alone: importing the generated
classes costs a fresh worker more than the exchange. Unknown fields are skipped; a
malformed answer is the transport's failure (:class:`UnavailableError`).

A daemon that predates the request refuses it (INVALID_ARGUMENT, reason
``LocalProtocolError``): :func:`is_not_understood` tells the caller to describe over
gRPC instead. Every other refusal (an unknown model, a version not held) is the
daemon's typed error, as gRPC would raise it.
"""

from __future__ import annotations

from typing import Final

from ..base.errors import UnavailableError, WeightdError
from .local import LocalConnection
from .localwire import Table, WireError, _bytes, _fill, _int, _raw, _str, _text, _uint

#: The daemon's error class for a request it does not know (a daemon that predates it).
NOT_UNDERSTOOD: Final = "LocalProtocolError"


class WireTensor:
    """``TensorDescription``."""

    __slots__ = ("digest", "dtype", "name", "nbytes", "shape", "shard")

    def __init__(self) -> None:
        self.name = ""
        self.dtype = ""
        self.shape: list[int] = []
        self.shard = ""
        self.nbytes = 0
        self.digest = ""


class WireFile:
    """``FileDigest``."""

    __slots__ = ("device", "inode", "mtime_ns", "name", "sample_digest", "sha256", "size")

    def __init__(self) -> None:
        self.name = ""
        self.size = 0
        self.sha256 = ""
        self.device = 0
        self.inode = 0
        self.mtime_ns = 0
        self.sample_digest = ""


class WireDescription:
    """``ModelDescription``, with the generated message's attribute names."""

    __slots__ = (
        "architecture",
        "config_json",
        "files",
        "host_boot_id",
        "model_fingerprint",
        "name",
        "tensors",
        "total_bytes",
        "trust_root",
        "version",
    )

    def __init__(self) -> None:
        self.name = ""
        self.architecture = ""
        self.config_json = ""
        self.tensors: list[WireTensor] = []
        self.total_bytes = 0
        self.files: list[WireFile] = []
        self.model_fingerprint = ""
        self.host_boot_id = ""
        self.version = 0
        self.trust_root = ""


def _int64(value: int | bytes) -> int:
    """An ``int64`` varint: negative numbers arrive as their 64-bit two's complement."""
    n = _int(value)
    return n - (1 << 64) if n >= 1 << 63 else n


_TENSOR: Table = {
    1: ("name", _str, False),
    2: ("dtype", _str, False),
    3: ("shape", _int, True),
    4: ("shard", _str, False),
    5: ("nbytes", _int, False),
    6: ("digest", _str, False),
}
_FILE: Table = {
    1: ("name", _str, False),
    2: ("size", _int, False),
    3: ("sha256", _str, False),
    4: ("device", _int, False),
    5: ("inode", _int, False),
    6: ("mtime_ns", _int64, False),
    7: ("sample_digest", _str, False),
}
_DESCRIPTION: Table = {
    1: ("name", _str, False),
    2: ("architecture", _str, False),
    3: ("config_json", _str, False),
    4: ("tensors", lambda v: _fill(WireTensor(), _raw(v), _TENSOR), True),
    5: ("total_bytes", _int, False),
    6: ("files", lambda v: _fill(WireFile(), _raw(v), _FILE), True),
    7: ("model_fingerprint", _str, False),
    8: ("host_boot_id", _str, False),
    9: ("version", _int, False),
    10: ("trust_root", _str, False),
}


def encode_describe(model: str, version: int) -> bytes:
    """A ``LocalRequest`` holding one ``DescribeModelRequest`` (field 10)."""
    return _bytes(10, _text(1, model) + _uint(2, version))


def decode_description(data: bytes) -> WireDescription:
    out: WireDescription = _fill(WireDescription(), data, _DESCRIPTION)
    return out


def describe_local(
    path: str, model: str, version: int, *, timeout: float | None
) -> WireDescription:
    """``model`` (empty: the daemon's only one) at ``version`` (0: the current one),
    described by the daemon listening on side socket ``path``."""
    conn = LocalConnection(path, "shm", timeout)
    try:
        response, _ = conn.exchange(encode_describe(model, version))
        if response.description is None:
            raise UnavailableError(
                f"side socket {path}: answer: expected a model description",
                transport="shm",
            )
        try:
            return decode_description(response.description)
        except WireError as exc:
            raise UnavailableError(
                f"side socket {path}: decoding the description: {exc}", transport="shm"
            ) from None
    finally:
        conn.close()


def is_not_understood(error: WeightdError) -> bool:
    """The daemon does not know the describe request (it predates it): ask over gRPC."""
    return error.reason == NOT_UNDERSTOOD
