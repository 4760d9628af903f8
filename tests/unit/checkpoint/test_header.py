"""Strict safetensors header parsing (``weightd.server.checkpoint.header``): what it accepts.

Golden bytes, files written by ``safetensors`` itself (checked against ``safe_open``),
and the valid corner cases: zero-size and scalar tensors, sub-byte dtypes, padding.
The malformed corpus is in ``test_header_corpus.py``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.unit.checkpoint.header_files import PATH, assemble, entry, js, parse_file
from weightd.server.checkpoint.header import HeaderEntry, header_length

# --- golden ------------------------------------------------------------------------

GOLDEN_HEADER = (
    b'{"__metadata__":{"format":"pt","note":"golden"},'
    b'"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
    b'"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]}}'
)


def golden_file() -> bytes:
    header = GOLDEN_HEADER + b" " * (-len(GOLDEN_HEADER) % 8)  # pad like the writer does
    data = np.arange(4, dtype="<f4").tobytes() + bytes([1, 2, 3, 4, 5, 6])
    return struct.pack("<Q", len(header)) + header + data


def test_golden_bytes_parse_to_exact_entries() -> None:
    blob = golden_file()
    assert len(GOLDEN_HEADER) == 160  # a multiple of 8: no padding needed
    assert blob[:8] == b"\xa0\x00\x00\x00\x00\x00\x00\x00"
    assert len(blob) == 8 + 160 + 22
    header = parse_file(PATH, blob)
    assert header.entries == (
        HeaderEntry("w", "F32", (2, 2), 0, 16),
        HeaderEntry("b", "BF16", (3,), 16, 22),
    )
    assert header.data_start == 168
    assert header.metadata == {"format": "pt", "note": "golden"}
    assert [e.nbytes for e in header.entries] == [16, 6]
    w, b = header.entries
    data = blob[header.data_start :]
    assert np.frombuffer(data[w.begin : w.end], "<f4").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert data[b.begin : b.end] == bytes([1, 2, 3, 4, 5, 6])


def test_entries_are_returned_in_data_order_not_json_order() -> None:
    doc = {"second": entry("U8", [4], 4, 8), "first": entry("F32", [1], 0, 4)}
    header = parse_file(PATH, assemble(js(doc), bytes(8)))
    assert [e.name for e in header.entries] == ["first", "second"]
    assert header.metadata == {}


def test_header_length_returns_the_prefix_value() -> None:
    blob = golden_file()
    assert header_length(PATH, blob[:8], len(blob)) == 160
    # exactly at the end of the file is allowed (an empty data section)
    assert header_length(PATH, struct.pack("<Q", 2), 10) == 2


def _torch_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_file_written_by_safetensors_matches_safe_open(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=gen),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=gen).half(),
        "ids": torch.arange(5, dtype=torch.int64),
        "flags": torch.tensor([1, 0, 1], dtype=torch.uint8),
        "mask": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "source": "unit"})
    blob = path.read_bytes()
    header = parse_file(str(path), blob)

    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        assert sorted(e.name for e in header.entries) == sorted(keys)
        assert header.metadata == f.metadata()
        by_name = {e.name: e for e in header.entries}
        for name in keys:
            sl = f.get_slice(name)
            e = by_name[name]
            assert e.dtype == sl.get_dtype(), name
            assert list(e.shape) == sl.get_shape(), name
            got = blob[header.data_start + e.begin : header.data_start + e.end]
            assert got == _torch_bytes(f.get_tensor(name)), name
    # the entries tile the data section exactly
    ends = [0] + [e.end for e in header.entries]
    assert [e.begin for e in header.entries] == ends[:-1]
    assert header.data_start + header.entries[-1].end == len(blob)


def test_zero_size_and_scalar_tensors_parse() -> None:
    doc = {
        "s": entry("F64", [], 0, 8),
        "a": entry("F32", [1], 8, 12),
        "z": entry("F32", [0, 4], 12, 12),
        "z2": entry("BF16", [3, 0, 2], 12, 12),
        "z0": entry("I64", [0], 0, 0),
    }
    header = parse_file(PATH, assemble(js(doc), bytes(12)))
    by_name = {e.name: e for e in header.entries}
    assert by_name["s"] == HeaderEntry("s", "F64", (), 0, 8)
    assert by_name["z"] == HeaderEntry("z", "F32", (0, 4), 12, 12)
    assert by_name["z2"] == HeaderEntry("z2", "BF16", (3, 0, 2), 12, 12)
    assert by_name["z0"] == HeaderEntry("z0", "I64", (0,), 0, 0)
    assert by_name["z"].nbytes == 0
    assert header.entries[-1].end == 12


def test_file_with_only_zero_size_tensors_and_no_data() -> None:
    header = parse_file(PATH, assemble(js({"z": entry("F32", [0], 0, 0)})))
    assert header.entries == (HeaderEntry("z", "F32", (0,), 0, 0),)


def test_sub_byte_dtype_filling_whole_bytes_is_accepted() -> None:
    header = parse_file(PATH, assemble(js({"p": entry("F4", [2, 3], 0, 3)}), bytes(3)))
    assert header.entries[0].nbytes == 3


def test_header_padded_with_trailing_spaces_is_accepted() -> None:
    raw = js({"a": entry("U8", [2], 0, 2)}) + b"        "
    header = parse_file(PATH, assemble(raw, b"xy"))
    assert header.data_start == 8 + len(raw)
