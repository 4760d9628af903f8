"""Strict safetensors header parsing (``weightd.server.checkpoint.header``): the malformed corpus.

Every rule of the parser broken once, each refused with its exact error type and a
message naming the file and the culprit; then the values just inside the limits. What
the parser accepts (golden and real files) is in ``test_header.py``.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest

from tests.unit.checkpoint.header_files import PATH, assemble, entry, js, parse_file
from weightd.server.base.errors import (
    AlignmentError,
    ByteSizeError,
    CheckpointError,
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
from weightd.server.checkpoint.header import MAX_HEADER_BYTES, MAX_NAME_CHARS, header_length

# --- malformed corpus ----------------------------------------------------------------
#
# Each case names the exact HeaderError subclass of the rule it breaks, and fragments
# that prove the message names the culprit tensor, field or value; that the message
# names the file is checked for every case by the test itself.


def _case(id_: str, error: type[HeaderError], blob: bytes, *needles: str) -> Any:
    return pytest.param(error, blob, needles, id=id_)


def _doc_file(doc: Any, data_len: int) -> bytes:
    return assemble(js(doc), bytes(data_len))


def _raw_file(text: str, data_len: int = 0) -> bytes:
    return assemble(text.encode(), bytes(data_len))


A4 = entry("F32", [1], 0, 4)
LONG_NAME = "x" * (MAX_NAME_CHARS + 1)

MALFORMED = [
    _case(
        "shorter-than-8-bytes",
        HeaderLengthError,
        b"\x05\x00\x00",
        "header length",
        "file is 3 bytes",
        "8-byte prefix",
    ),
    _case("empty-file", HeaderLengthError, b"", "header length", "file is 0 bytes"),
    _case(
        "header-length-above-cap",
        HeaderLengthError,
        struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}",
        f"header length {MAX_HEADER_BYTES + 1}",
        f"limit of {MAX_HEADER_BYTES} bytes",
    ),
    _case(
        "header-length-huge",
        HeaderLengthError,
        struct.pack("<Q", 2**64 - 1) + b"{}",
        f"header length {2**64 - 1}",
    ),
    _case(
        "header-length-past-eof",
        HeaderLengthError,
        assemble(b"{}", declared=100),
        "header length 100",
        "10-byte file",
    ),
    _case(
        "not-utf8", HeaderEncodingError, assemble(b'{"caf\xe9": 1}'), "not UTF-8", "header byte 5"
    ),
    _case("not-json", HeaderSyntaxError, _raw_file('{"a": {"dtype": "F32",'), "not valid JSON"),
    _case(
        "json-array", HeaderSyntaxError, _raw_file("[1, 2]"), "must be a JSON object", "got list"
    ),
    _case("json-string", HeaderSyntaxError, _raw_file('"a"'), "must be a JSON object", "got str"),
    _case(
        "duplicate-tensor-key",
        DuplicateKeyError,
        _raw_file(
            '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
            ' "w": {"dtype": "I32", "shape": [1], "data_offsets": [0, 4]}}',
            4,
        ),
        "duplicate tensor 'w'",
    ),
    _case(
        "duplicate-key-inside-entry",
        DuplicateKeyError,
        _raw_file('{"w": {"dtype": "F32", "dtype": "I32", "shape": [1], "data_offsets": [0, 4]}}'),
        "tensor 'w'",
        "duplicate field 'dtype'",
    ),
    _case(
        "duplicate-metadata-key",
        DuplicateKeyError,
        _raw_file('{"__metadata__": {"a": "1"}, "__metadata__": {"a": "2"}}'),
        "duplicate object '__metadata__'",
    ),
    _case(
        "nan-in-shape",
        NonFiniteNumberError,
        _raw_file('{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', 4),
        "tensor 'w'",
        "NaN",
    ),
    _case(
        "infinity-in-offsets",
        NonFiniteNumberError,
        _raw_file('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, Infinity]}}', 4),
        "tensor 'w'",
        "Infinity",
    ),
    _case(
        "negative-infinity-in-metadata",
        NonFiniteNumberError,
        _raw_file('{"__metadata__": {"x": -Infinity}}'),
        "__metadata__",
        "-Infinity",
    ),
    _case("empty-name", TensorNameError, _doc_file({"": A4}, 4), "tensor name ''", "is empty"),
    _case(
        "nul-in-name",
        TensorNameError,
        _doc_file({"a\x00b": A4}, 4),
        "'a\\x00b'",
        "control character '\\x00'",
    ),
    _case(
        "c0-control-in-name",
        TensorNameError,
        _doc_file({"a\x1fb": A4}, 4),
        "'a\\x1fb'",
        "control character '\\x1f'",
    ),
    _case(
        "del-in-name",
        TensorNameError,
        _doc_file({"a\x7f": A4}, 4),
        "'a\\x7f'",
        "control character '\\x7f'",
    ),
    _case(
        "zero-width-space-in-name",
        TensorNameError,
        _doc_file({"a\u200bb": A4}, 4),
        "'a\\u200bb'",
        "control character",
    ),
    _case(
        "line-separator-in-name",
        TensorNameError,
        _doc_file({"a\u2028b": A4}, 4),
        "'a\\u2028b'",
        "control character",
    ),
    _case(
        "lone-surrogate-in-name",
        TensorNameError,
        _raw_file('{"a\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 4),
        "'a\\ud800'",
        "control character",
    ),
    _case(
        "over-long-name",
        TensorNameError,
        _doc_file({LONG_NAME: A4}, 4),
        "tensor name 'xxxx",
        f"{MAX_NAME_CHARS + 1} characters",
    ),
    _case(
        "unknown-dtype",
        DtypeError,
        _doc_file({"w": entry("F128", [1], 0, 16)}, 16),
        "'w'",
        "dtype 'F128'",
    ),
    _case(
        "lowercase-dtype", DtypeError, _doc_file({"w": entry("f32", [1], 0, 4)}, 4), "'w'", "'f32'"
    ),
    # Fails against the current server, on purpose: it says "dtype 'int'", the very
    # message the *string* dtype "int" gets, and never names the value 32.
    _case("non-string-dtype", DtypeError, _doc_file({"w": entry(32, [1], 0, 4)}, 4), "'w'", "32"),
    _case(
        "negative-dim",
        ShapeError,
        _doc_file({"w": entry("F32", [2, -1], 0, 0)}, 0),
        "'w'",
        "shape [2, -1]",
        "negative",
    ),
    _case(
        "float-dim",
        ShapeError,
        _doc_file({"w": entry("F32", [2.0], 0, 8)}, 8),
        "'w'",
        "shape",
        "[2.0]",
    ),
    _case(
        "bool-dim",
        ShapeError,
        _doc_file({"w": entry("F32", [True], 0, 4)}, 4),
        "'w'",
        "shape",
        "[True]",
    ),
    _case(
        "string-dim",
        ShapeError,
        _doc_file({"w": entry("F32", ["2"], 0, 8)}, 8),
        "'w'",
        "shape",
        "['2']",
    ),
    _case(
        "shape-not-a-list",
        ShapeError,
        _doc_file({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 16]}}, 16),
        "'w'",
        "shape must be a list of integers",
        "got 4",
    ),
    _case(
        "shape-overflows",
        ShapeError,
        _doc_file({"w": entry("F32", [2**40, 2**40], 0, 4)}, 4),
        "'w'",
        f"shape [{2**40}, {2**40}]",
        "overflows",
    ),
    _case(
        "offsets-length-3",
        OffsetsError,
        _doc_file({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, 4),
        "'w'",
        "data_offsets must be [begin, end]",
        "[0, 4, 8]",
    ),
    _case(
        "offsets-length-1",
        OffsetsError,
        _doc_file({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}, 4),
        "'w'",
        "data_offsets",
        "[4]",
    ),
    _case(
        "float-offset",
        OffsetsError,
        _doc_file({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}, 4),
        "'w'",
        "data_offsets must be a list of integers",
        "[0, 4.0]",
    ),
    _case(
        "end-before-begin",
        OffsetsError,
        _doc_file({"w": entry("F32", [0], 8, 4)}, 8),
        "'w'",
        "[8, 4]",
        "begin <= end",
    ),
    _case(
        "negative-begin",
        OffsetsError,
        _doc_file({"w": entry("F32", [1], -4, 0)}, 4),
        "'w'",
        "[-4, 0]",
    ),
    _case(
        "byte-size-mismatch",
        ByteSizeError,
        _doc_file({"w": entry("F32", [3], 0, 8)}, 8),
        "'w'",
        "span 8 bytes",
        "expected 12",
    ),
    _case(
        "sub-byte-partial",
        ByteSizeError,
        _doc_file({"w": entry("F4", [3], 0, 2)}, 2),
        "'w'",
        "F4 shape [3]",
        "whole number of bytes",
    ),
    _case(
        "gap-between-tensors",
        OffsetsError,
        _doc_file({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)}, 12),
        "tensor 'b'",
        "data_offsets [8, 12]",
        "gap of 4 bytes after 'a'",
    ),
    _case(
        "gap-at-start",
        OffsetsError,
        _doc_file({"a": entry("F32", [1], 4, 8)}, 8),
        "tensor 'a'",
        "data_offsets [4, 8]",
        "gap of 4 bytes after the start of the data section",
    ),
    _case(
        "overlap",
        OffsetsError,
        _doc_file({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, 8),
        "tensor 'b'",
        "data_offsets [4, 8]",
        "overlap 'a', which ends at 8",
    ),
    _case(
        "same-offsets-twice",
        OffsetsError,
        _doc_file({"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 0, 4)}, 4),
        "tensor 'b'",
        "data_offsets [0, 4]",
        "share their byte range with tensor 'a'",
    ),
    _case(
        "trailing-bytes",
        DataSectionError,
        _doc_file({"a": entry("F32", [1], 0, 4)}, 7),
        "3 trailing bytes after tensor 'a'",
        "data offset 4",
    ),
    _case(
        "trailing-bytes-without-tensors",
        DataSectionError,
        _doc_file({}, 1),
        "1 trailing bytes",
        "data offset 0",
    ),
    _case(
        "truncated-data",
        DataSectionError,
        _doc_file({"a": entry("F32", [1], 0, 4), "b": entry("F32", [2], 4, 12)}, 10),
        "truncated",
        "need 12 bytes",
        "holds 10",
        "tensor 'b' ends at 12",
    ),
    _case(
        "non-string-metadata-value",
        MetadataError,
        _doc_file({"__metadata__": {"format": "pt", "step": 3}}, 0),
        "__metadata__['step']",
        "got int",
    ),
    _case(
        "metadata-not-object",
        MetadataError,
        _doc_file({"__metadata__": ["pt"]}, 0),
        "__metadata__",
        "got list",
    ),
    _case(
        "misaligned-f32",
        AlignmentError,
        _doc_file({"u": entry("U8", [2], 0, 2), "w": entry("F32", [1], 2, 6)}, 6),
        "tensor 'w'",
        "data_offsets begin 2",
        "4-byte F32",
    ),
    _case(
        "misaligned-bf16",
        AlignmentError,
        _doc_file({"u": entry("U8", [1], 0, 1), "h": entry("BF16", [1], 1, 3)}, 3),
        "tensor 'h'",
        "data_offsets begin 1",
        "2-byte BF16",
    ),
    _case(
        "unknown-extra-field",
        TensorEntryError,
        _doc_file({"w": {**A4, "offsets": [0, 4]}}, 4),
        "'w'",
        "unknown field 'offsets'",
    ),
    _case(
        "missing-dtype",
        TensorEntryError,
        _doc_file({"w": {"shape": [1], "data_offsets": [0, 4]}}, 4),
        "'w'",
        "missing field 'dtype'",
    ),
    _case(
        "missing-data-offsets",
        TensorEntryError,
        _doc_file({"w": {"dtype": "F32", "shape": [1]}}, 4),
        "'w'",
        "missing field 'data_offsets'",
    ),
    _case(
        "entry-not-object",
        TensorEntryError,
        _doc_file({"w": [0, 4]}, 4),
        "'w'",
        "entry must be an object",
        "got list",
    ),
    _case("empty-header", HeaderSyntaxError, _raw_file(""), "not valid JSON"),
    _case(
        "deep-nesting",
        HeaderSyntaxError,
        _raw_file("[" * 100_000 + "]" * 100_000),
        "not valid JSON",
    ),
]


@pytest.mark.parametrize(("error", "blob", "needles"), MALFORMED)
def test_malformed_header_is_rejected(
    error: type[HeaderError], blob: bytes, needles: tuple[str, ...]
) -> None:
    with pytest.raises(error) as info:
        parse_file(PATH, blob)
    err = info.value
    assert type(err) is error, f"{type(err).__name__}: {err}"
    assert isinstance(err, HeaderError)
    assert isinstance(err, CheckpointError)
    assert err.path == PATH
    assert str(err).startswith(f"{PATH}: ")
    for needle in needles:
        assert needle in err.problem, (needle, str(err))


def test_name_at_the_length_limit_is_accepted() -> None:
    name = "n" * MAX_NAME_CHARS
    header = parse_file(PATH, _doc_file({name: A4}, 4))
    assert header.entries[0].name == name


def test_non_ascii_printable_name_is_accepted() -> None:
    header = parse_file(PATH, _doc_file({"modèle.权重": A4}, 4))
    assert header.entries[0].name == "modèle.权重"


def test_header_length_exactly_at_cap_passes_the_cap_check() -> None:
    size = 8 + MAX_HEADER_BYTES
    assert header_length(PATH, struct.pack("<Q", MAX_HEADER_BYTES), size) == MAX_HEADER_BYTES
