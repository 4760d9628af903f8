"""Strict, pure parsing of safetensors headers.

The reference parser is lenient in ways that matter for a server that vouches for
bytes: it keeps the last of duplicate keys (even with another dtype), accepts empty
and NUL names and unaligned offsets, and Python's ``json`` accepts ``NaN``. Here any
of those is a :class:`~weightd.server.errors.HeaderError` naming the file, the
tensor and the field. The functions do no I/O: the loader hands them bytes.

Policy on alignment: a tensor whose offset is not a multiple of its element size is
rejected rather than copied, so every tensor can be viewed in place.
"""

from __future__ import annotations

import json
import math
import struct
import unicodedata
from dataclasses import dataclass
from typing import Any, Final

from weightd.common.dtypes import DTYPE_BITS, nbytes_for

from .errors import HeaderError

#: Largest header accepted. The reference allows 100 MB; a header entry takes about
#: 120 bytes, so 32 MiB still admits ~250k tensors in one file (DeepSeek-V3, the
#: largest public checkpoint by tensor count, has ~91k in all). A smaller cap bounds
#: the memory a hostile file can make the daemon spend before anything is checked.
MAX_HEADER_BYTES: Final = 32 << 20
#: Longest tensor name accepted, in characters.
MAX_NAME_CHARS: Final = 1024
_TENSOR_KEYS: Final = frozenset({"dtype", "shape", "data_offsets"})
_MAX_BYTES: Final = 1 << 62


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offset within the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class Header:
    entries: tuple[HeaderEntry, ...]  # in data order
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data section


def header_length(path: str, prefix: bytes, file_size: int) -> int:
    """Validate the 8-byte length prefix against the file size and the cap."""
    if file_size < 8 or len(prefix) < 8:
        raise HeaderError(path, f"file is {file_size} bytes, shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise HeaderError(
            path, f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes"
        )
    if length > file_size - 8:
        raise HeaderError(
            path, f"header length {length} runs past the end of the {file_size}-byte file"
        )
    return int(length)


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-finite number {token} is not valid JSON")


def _unique_object(path: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise HeaderError(path, f"duplicate key {key!r} in header")
            out[key] = value
        return out

    return hook


def _check_name(path: str, name: str) -> None:
    if not name:
        raise HeaderError(path, "empty tensor name")
    if len(name) > MAX_NAME_CHARS:
        raise HeaderError(
            path, f"tensor name {name[:64]!r}... is {len(name)} characters (limit {MAX_NAME_CHARS})"
        )
    for ch in name:
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            raise HeaderError(path, f"tensor name {name!r} contains control character {ch!r}")


def _int_list(path: str, name: str, field: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise HeaderError(
            path, f"tensor {name!r}: {field} must be a list of integers, got {value!r}"
        )
    return value


def _entry(path: str, name: str, info: Any) -> HeaderEntry:
    _check_name(path, name)
    if not isinstance(info, dict):
        raise HeaderError(
            path, f"tensor {name!r}: entry must be an object, got {type(info).__name__}"
        )
    missing = _TENSOR_KEYS - info.keys()
    if missing:
        raise HeaderError(path, f"tensor {name!r}: missing field {sorted(missing)[0]!r}")
    extra = info.keys() - _TENSOR_KEYS
    if extra:
        raise HeaderError(path, f"tensor {name!r}: unknown field {sorted(extra)[0]!r}")
    dtype = info["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise HeaderError(path, f"tensor {name!r}: dtype {dtype!r} is not a safetensors dtype")
    shape = _int_list(path, name, "shape", info["shape"])
    if any(d < 0 for d in shape):
        raise HeaderError(path, f"tensor {name!r}: shape {shape} has a negative dimension")
    if math.prod(shape) * DTYPE_BITS[dtype] // 8 > _MAX_BYTES:
        raise HeaderError(path, f"tensor {name!r}: shape {shape} overflows")
    offsets = _int_list(path, name, "data_offsets", info["data_offsets"])
    if len(offsets) != 2:
        raise HeaderError(
            path, f"tensor {name!r}: data_offsets must be [begin, end], got {offsets}"
        )
    begin, end = offsets
    if begin < 0 or end < begin:
        raise HeaderError(
            path, f"tensor {name!r}: data_offsets {offsets} are not 0 <= begin <= end"
        )
    expected = nbytes_for(dtype, shape)
    if expected is None:
        raise HeaderError(
            path, f"tensor {name!r}: {dtype} shape {shape} does not fill a whole number of bytes"
        )
    if end - begin != expected:
        raise HeaderError(
            path,
            f"tensor {name!r}: data_offsets {offsets} span {end - begin} bytes, "
            f"expected {expected} for {dtype} {shape}",
        )
    align = max(DTYPE_BITS[dtype] // 8, 1)
    if begin % align:
        raise HeaderError(
            path,
            f"tensor {name!r}: offset {begin} is not aligned to its {align}-byte {dtype} elements",
        )
    return HeaderEntry(name, dtype, tuple(shape), begin, end)


def parse_header(path: str, raw: bytes, file_size: int) -> Header:
    """Parse and check the JSON header ``raw`` read from a file of ``file_size`` bytes.

    ``raw`` is exactly the header bytes (after the 8-byte length). The result lists
    the tensors in data order, proven to tile the data section with no gap, overlap
    or trailing byte.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(path, f"header is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        doc = json.loads(
            text, object_pairs_hook=_unique_object(path), parse_constant=_reject_constant
        )
    except HeaderError:
        raise
    except (ValueError, RecursionError) as exc:
        raise HeaderError(path, f"header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise HeaderError(path, f"header must be a JSON object, got {type(doc).__name__}")
    metadata: dict[str, str] = {}
    raw_meta = doc.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict):
            raise HeaderError(path, "__metadata__ must be an object of strings")
        for key, value in raw_meta.items():
            if not isinstance(value, str):
                raise HeaderError(
                    path, f"__metadata__[{key!r}] must be a string, got {type(value).__name__}"
                )
            metadata[key] = value
    entries = sorted((_entry(path, n, i) for n, i in doc.items()), key=lambda e: (e.begin, e.end))
    data_start = 8 + len(raw)
    data_len = file_size - data_start
    cursor = 0
    previous = "the start of the data section"
    for e in entries:
        if e.begin != cursor:
            kind = "a gap" if e.begin > cursor else "an overlap"
            raise HeaderError(
                path,
                f"tensor {e.name!r}: data_offsets begin at {e.begin} but {previous} ends at "
                f"{cursor} ({kind})",
            )
        cursor = e.end
        previous = f"tensor {e.name!r}"
    if cursor > data_len:
        raise HeaderError(
            path, f"data section is truncated: tensors need {cursor} bytes, file holds {data_len}"
        )
    if cursor < data_len:
        raise HeaderError(
            path,
            f"{data_len - cursor} trailing bytes after the last tensor (at data offset {cursor})",
        )
    return Header(tuple(entries), metadata, data_start)
