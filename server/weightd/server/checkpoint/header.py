"""Strict, pure parsing of safetensors headers.

The reference parser is lenient in ways that matter for a server that vouches for
bytes: it keeps the last of duplicate keys (even with another dtype), accepts empty
and NUL names and unaligned offsets, and Python's ``json`` accepts ``NaN``. Here any
of those is a :class:`~weightd.server.base.errors.HeaderError` naming the file, the
tensor and the field; each rule family raises its own subclass (``DuplicateKeyError``,
``OffsetsError``, ...). The functions do no I/O: the loader hands them bytes.

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

from ..base.errors import (
    AlignmentError,
    ByteSizeError,
    DataSectionError,
    DtypeError,
    DuplicateKeyError,
    HeaderEncodingError,
    HeaderError,
    HeaderLengthError,
    HeaderSyntaxError,
    MetadataError,
    NonFiniteNumberError,
    OffsetsError,
    ShapeError,
    TensorEntryError,
    TensorNameError,
)

#: Largest header accepted. The reference allows 100 MB; a header entry takes about
#: 120 bytes, so 32 MiB still admits ~250k tensors in one file (DeepSeek-V3, the
#: largest public checkpoint by tensor count, has ~91k in all). A smaller cap bounds
#: the memory a hostile file can make the daemon spend before anything is checked.
MAX_HEADER_BYTES: Final = 32 << 20
#: Longest tensor name accepted, in characters.
MAX_NAME_CHARS: Final = 1024
#: Most dimensions a tensor may have (torch allows 64 for a tensor; no weight has more).
MAX_RANK: Final = 64
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
        raise HeaderLengthError(
            path, f"header length: file is {file_size} bytes, shorter than the 8-byte prefix"
        )
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise HeaderLengthError(
            path, f"header length {length} exceeds the limit of {MAX_HEADER_BYTES} bytes"
        )
    if length > file_size - 8:
        raise HeaderLengthError(
            path, f"header length {length} runs past the end of the {file_size}-byte file"
        )
    return int(length)


class _Object(dict[str, Any]):
    """A parsed JSON object that remembers which keys it saw twice (the last one is kept).

    Duplicates are recorded rather than raised inside the decoder so the error can
    say *where* they are (which tensor's entry, or ``__metadata__``), which the
    decoder hook alone cannot know.
    """

    duplicates: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    out = _Object()
    dups: list[str] = []
    for key, value in pairs:
        if key in out:
            dups.append(key)
        out[key] = value
    if dups:
        out.duplicates = tuple(dups)
    return out


class NonFinite:
    """Stands in for ``NaN``/``Infinity`` while parsing, so the error can name its place."""

    __slots__ = ("token",)

    def __init__(self, token: str) -> None:
        self.token = token

    def __repr__(self) -> str:
        return self.token


def _find_nonfinite(value: Any) -> NonFinite | None:
    if isinstance(value, NonFinite):
        return value
    children = value.values() if isinstance(value, dict) else value
    if isinstance(value, (dict, list)):
        for child in children:
            found = _find_nonfinite(child)
            if found is not None:
                return found
    return None


def strict_json_loads(text: str) -> Any:
    """``json.loads`` that keeps duplicates visible (:class:`_Object`) and NaN as a marker.

    Raises ValueError / RecursionError for text that is not JSON at all.
    """
    return json.loads(text, object_pairs_hook=_object, parse_constant=NonFinite)


def _check_name(path: str, name: str) -> None:
    if not name:
        raise TensorNameError(path, "tensor name '' (a header key) is empty")
    if len(name) > MAX_NAME_CHARS:
        raise TensorNameError(
            path, f"tensor name {name[:64]!r}... is {len(name)} characters (limit {MAX_NAME_CHARS})"
        )
    for ch in name:
        if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            raise TensorNameError(path, f"tensor name {name!r} contains control character {ch!r}")


def _int_list(path: str, name: str, field: str, value: Any, error: type[HeaderError]) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise error(path, f"tensor {name!r}: {field} must be a list of integers, got {shown}")
    return value


def _entry(path: str, name: str, info: Any) -> HeaderEntry:
    _check_name(path, name)
    if not isinstance(info, dict):
        raise TensorEntryError(
            path, f"tensor {name!r}: entry must be an object, got {type(info).__name__}"
        )
    dups = getattr(info, "duplicates", ())
    if dups:
        raise DuplicateKeyError(path, f"tensor {name!r}: duplicate field {dups[0]!r}")
    missing = _TENSOR_KEYS - info.keys()
    if missing:
        raise TensorEntryError(path, f"tensor {name!r}: missing field {sorted(missing)[0]!r}")
    extra = info.keys() - _TENSOR_KEYS
    if extra:
        raise TensorEntryError(path, f"tensor {name!r}: unknown field {sorted(extra)[0]!r}")
    dtype = info["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        if isinstance(dtype, str):
            shown = repr(dtype[:32]) + ("..." if len(dtype) > 32 else "")
            raise DtypeError(path, f"tensor {name!r}: dtype {shown} is not a safetensors dtype")
        raise DtypeError(
            path,
            f"tensor {name!r}: dtype must be a string, got {type(dtype).__name__} "
            f"{repr(dtype)[:32]}",
        )
    shape = _int_list(path, name, "shape", info["shape"], ShapeError)
    if any(d < 0 for d in shape):
        raise ShapeError(path, f"tensor {name!r}: shape {shape} has a negative dimension")
    if len(shape) > MAX_RANK:
        raise ShapeError(
            path, f"tensor {name!r}: shape has {len(shape)} dimensions (limit {MAX_RANK})"
        )
    if math.prod(shape) * DTYPE_BITS[dtype] // 8 > _MAX_BYTES:
        raise ShapeError(path, f"tensor {name!r}: shape {shape} overflows")
    offsets = _int_list(path, name, "data_offsets", info["data_offsets"], OffsetsError)
    if len(offsets) != 2:
        raise OffsetsError(
            path, f"tensor {name!r}: data_offsets must be [begin, end], got {offsets}"
        )
    begin, end = offsets
    if begin < 0 or end < begin or end > _MAX_BYTES:
        raise OffsetsError(
            path, f"tensor {name!r}: data_offsets {offsets} are not 0 <= begin <= end"
        )
    expected = nbytes_for(dtype, shape)
    if expected is None:
        raise ByteSizeError(
            path, f"tensor {name!r}: {dtype} shape {shape} does not fill a whole number of bytes"
        )
    if end - begin != expected:
        raise ByteSizeError(
            path,
            f"tensor {name!r}: data_offsets {offsets} span {end - begin} bytes, "
            f"expected {expected} for {dtype} {shape}",
        )
    align = max(DTYPE_BITS[dtype] // 8, 1)
    if begin % align:
        raise AlignmentError(
            path,
            f"tensor {name!r}: data_offsets begin {begin} is not aligned to its "
            f"{align}-byte {dtype} elements",
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
        raise HeaderEncodingError(
            path, f"header is not UTF-8 ({exc.reason} at header byte {exc.start})"
        ) from None
    try:
        doc = strict_json_loads(text)
    except (ValueError, RecursionError) as exc:
        raise HeaderSyntaxError(path, f"header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise HeaderSyntaxError(path, f"header must be a JSON object, got {type(doc).__name__}")
    for key, value in doc.items():
        bad = _find_nonfinite(value)
        if bad is not None:
            where = "__metadata__" if key == "__metadata__" else f"tensor {key!r}"
            raise NonFiniteNumberError(
                path, f"{where}: non-finite number {bad.token} is not valid JSON"
            )
    dups = getattr(doc, "duplicates", ())
    if dups:
        what = "object" if dups[0] == "__metadata__" else "tensor"
        raise DuplicateKeyError(
            path, f"duplicate {what} {dups[0]!r} in header (the reference parser keeps the last)"
        )
    metadata: dict[str, str] = {}
    raw_meta = doc.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict):
            raise MetadataError(
                path, f"__metadata__ must be an object of strings, got {type(raw_meta).__name__}"
            )
        meta_dups = getattr(raw_meta, "duplicates", ())
        if meta_dups:
            raise DuplicateKeyError(path, f"__metadata__: duplicate key {meta_dups[0]!r}")
        for key, value in raw_meta.items():
            if not isinstance(value, str):
                raise MetadataError(
                    path, f"__metadata__[{key!r}] must be a string, got {type(value).__name__}"
                )
            metadata[key] = value
    entries = sorted((_entry(path, n, i) for n, i in doc.items()), key=lambda e: (e.begin, e.end))
    data_start = 8 + len(raw)
    data_len = file_size - data_start
    cursor = 0
    previous: HeaderEntry | None = None
    for e in entries:
        if e.begin != cursor:
            after = "the start of the data section" if previous is None else f"{previous.name!r}"
            if e.begin > cursor:
                kind = f"leave a gap of {e.begin - cursor} bytes after {after}"
            elif previous is not None and (previous.begin, previous.end) == (e.begin, e.end):
                kind = f"share their byte range with tensor {previous.name!r}"
            else:
                kind = f"overlap {after}, which ends at {cursor}"
            raise OffsetsError(path, f"tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] {kind}")
        cursor = e.end
        previous = e
    if cursor > data_len:
        last = f" (tensor {previous.name!r} ends at {cursor})" if previous else ""
        raise DataSectionError(
            path,
            f"data section is truncated: tensors need {cursor} bytes, file holds {data_len}{last}",
        )
    if cursor < data_len:
        last = f"tensor {previous.name!r}" if previous else "the header"
        raise DataSectionError(
            path,
            f"data section: {data_len - cursor} trailing bytes after {last} "
            f"(at data offset {cursor}); refusing a polyglot file",
        )
    return Header(tuple(entries), metadata, data_start)
