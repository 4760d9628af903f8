"""The client's Fetch parser (``weightd.client.receive.fetchwire``) reads the wire as protobuf does.

For any input, it must accept what protobuf accepts with the same content, and refuse
what protobuf refuses with ``DataLossError``. The daemon's encoder, which writes these
bytes, is tested in ``tests/unit/rpc/test_wire.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.wire_messages import HEADER, _pair
from weightd.client.base.errors import DataLossError
from weightd.client.receive.fetchwire import WireResponse, from_message, parse_fetch_response
from weightd.v1 import weightd_pb2 as pb


def _fields(r: WireResponse) -> tuple[Any, ...]:
    return (
        [
            (
                c.index,
                None if c.header is None else c.header.SerializeToString(),
                c.offset,
                bytes(c.data),
                c.digest,
            )
            for c in r.chunks
        ],
        None if r.done is None else r.done.SerializeToString(),
        None if r.adapter is None else r.adapter.SerializeToString(),
        r.model_fingerprint,
        r.slice_digest,
        r.vocab_pad,
    )


def _as_protobuf_reads(raw: bytes) -> tuple[Any, ...] | None:
    try:
        return _fields(from_message(pb.FetchResponse.FromString(raw)))
    except Exception:
        return None


def _as_we_read(raw: bytes) -> tuple[Any, ...] | None:
    try:
        return _fields(parse_fetch_response(raw))
    except DataLossError:
        return None


VALID = _pair(
    [
        {"index": 0, "header": HEADER, "data": b"\x01\x02\x03", "digest": "sha256:aa"},
        {"index": 1, "header": pb.SliceHeader(name="e"), "digest": "sha256:bb"},
        {"index": 2, "header": HEADER, "offset": 0, "data": b"\xff" * 130},
        {"index": 2, "offset": 130, "data": b"z" * 5, "digest": "sha256:cc"},
    ],
    pb.FetchDone(num_tensors=3, total_bytes=138),
    "fp",
)[0]


def test_parser_reads_what_the_daemon_writes_as_views_of_the_message() -> None:
    r = parse_fetch_response(VALID)
    assert _fields(r) == _as_protobuf_reads(VALID)
    assert r.chunks[0].header is not None and r.chunks[0].header.name == HEADER.name
    assert r.chunks[3].header is None
    assert r.chunks[1].data.nbytes == 0
    assert r.chunks[2].data.obj is VALID  # no copy of the payload
    assert r.done is not None and r.done.num_tensors == 3
    assert r.adapter is None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\x12\x00",  # done, all defaults
        b"\x1a\x05\x0a\x03abc",  # adapter set (FetchAdapter's first message)
        b"\x0a\x00",  # one chunk, every field default
        b"\x0a\x02\x12\x00",  # a chunk whose header is set but empty
        # Valid, but not as the daemon writes it: protobuf decides, the result is the same.
        b"\x0a\x04\x08\x01\x08\x02",  # index twice: the last wins
        b"\x0a\x06\x22\x01a\x22\x01b",  # data twice: the last wins
        b"\x0a\x08\x12\x02\x0a\x00\x12\x02\x10\x00",  # header twice: merged
        b"\x12\x02\x08\x01\x12\x02\x10\x02",  # done twice: merged
        b"\x22\x01a\x22\x01b",  # fingerprint twice
        b"\x22\x02fp\x2a\x06blake3",  # fingerprint and the slice digest kind (Fetch's first)
        b"\x2a\x01a\x2a\x01b",  # slice digest kind twice
        b"\x22\x02fp\x30\x40",  # fingerprint and vocab_pad 64 (Fetch's first message)
        b"\x30\x40\x30\x80\x01",  # vocab_pad twice: the last wins
        b"\x30\x80\x80\x80\x80\x10",  # vocab_pad past uint32: protobuf truncates it
        b"\x32\x00",  # vocab_pad (field 6) with the length wire type: unknown field
        b"\x0a\x03\x30\x96\x01",  # an unknown field in a chunk
        b"\x38\x05\x0a\x00",  # an unknown top-level field
        b"\x0a\x03\x08\x80\x00",  # a non-minimal varint
        b"\x0a\x04\x18\x01\x08\x02",  # fields out of order
        b"\x0a\x03\x22\x01\x08",  # one byte of data
        b"\x0a\x02\x20\x05",  # data (field 4) with the varint wire type: unknown field
        b"\x08\x05",  # chunks (field 1) with the varint wire type: unknown field
        b"\x0a\x0a\x08\xff\xff\xff\xff\x1f\x18\x01\x22\x00",  # index past uint32
        b"\x0a\x0b\x18\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # offset = 2**64 - 1
    ],
)
def test_parser_agrees_with_protobuf_on_valid_input(raw: bytes) -> None:
    theirs = _as_protobuf_reads(raw)
    assert theirs is not None
    assert _as_we_read(raw) == theirs


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a",  # a key without its length
        b"\x0a\x05\x08",  # a length past the end
        b"\x0a\x02\x08",  # a varint cut short
        b"\x0a\x01\x80",
        b"\x0a\x0c\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # an 11-byte varint
        b"\x0a\x03\x2a\x01\xff",  # a digest that is not UTF-8
        b"\x22\x01\xc3",  # a fingerprint that is not UTF-8
        b"\x2a\x01\xc3",  # a slice digest kind that is not UTF-8
        b"\x0a\x04\x12\x02\x0a\x05",  # a header whose name runs past its end
        b"\x12\x01\x08",  # a done cut short
        b"\x02\x00",  # field number 0
        b"\x0b\x00",  # a group start (wire type 3) with no end
        b"\x0f\x00",  # wire type 7
    ],
)
def test_parser_refuses_malformed_input_with_data_loss(raw: bytes) -> None:
    assert _as_protobuf_reads(raw) is None
    with pytest.raises(DataLossError, match="malformed FetchResponse"):
        parse_fetch_response(raw)


@given(st.data())
@settings(max_examples=400, deadline=None)
def test_parser_agrees_with_protobuf_on_mutated_messages(data: st.DataObject) -> None:
    raw = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(raw) - 1)))
        if kind == "flip" and raw:
            raw[pos] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            del raw[pos : pos + data.draw(st.integers(1, 4))]
        else:
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=3))
    assert _as_we_read(bytes(raw)) == _as_protobuf_reads(bytes(raw))
