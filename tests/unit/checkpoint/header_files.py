"""Safetensors files built byte by byte, and the loader's way of parsing one.

Shared by the header parser's tests (``test_header.py``, ``test_header_corpus.py``).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from weightd.server.checkpoint.header import Header, header_length, parse_header

PATH = "/models/demo/model-00001-of-00002.safetensors"


def parse_file(path: str, blob: bytes) -> Header:
    """What the loader does (checkpoint_scan.read_header), on the whole file's bytes."""
    length = header_length(path, blob[:8], len(blob))
    return parse_header(path, blob[8 : 8 + length], len(blob))


def assemble(header: bytes, data: bytes = b"", *, declared: int | None = None) -> bytes:
    """A file: little-endian u64 length, the header bytes, then the data section."""
    length = len(header) if declared is None else declared
    return struct.pack("<Q", length) + header + data


def js(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def entry(dtype: str, shape: list[Any], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
