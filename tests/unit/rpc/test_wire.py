"""The daemon's hand-written Fetch encoder (``weightd.server.rpc.wire``): protobuf's bytes.

Every message it encodes must be exactly ``SerializeToString`` of the same
``FetchResponse``; the client's parser of the same bytes is tested in
``tests/unit/client/test_fetchwire.py``.
"""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.wire_messages import HEADER, U32, U64, _pair
from weightd.server.base.errors import DataIntegrityError
from weightd.server.rpc import wire as server_wire
from weightd.server.rpc.weights import WeightsService, add_weights_service
from weightd.server.rpc.wire import (
    WEIGHTS_SERVICE,
    EncodedResponse,
    payload_bytes,
    serialize_fetch_response,
)
from weightd.v1 import weightd_pb2 as pb


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, U32, U32 + 1, U64])
def test_varint_matches_protobuf(value: int) -> None:
    packed = pb.SliceHeader(shape=[value]).SerializeToString()  # key, length, the varint
    assert server_wire.varint(value) == packed[2:]


@pytest.mark.parametrize("value", [-1, U64 + 1])
def test_varint_refuses_what_does_not_fit_a_uint64(value: int) -> None:
    with pytest.raises(ValueError):
        server_wire.varint(value)


@pytest.mark.parametrize(
    ("chunks", "done", "fingerprint"),
    [
        ([], None, ""),  # an empty message
        ([], None, "sha256:" + "ab" * 32),  # the first message of a Fetch
        ([], pb.FetchDone(), ""),  # done with every field 0 is still written
        ([], pb.FetchDone(num_tensors=3, total_bytes=1 << 40), ""),
        ([{"header": pb.SliceHeader(), "digest": "sha256:e3b0"}], None, ""),  # empty header
        ([{"header": pb.SliceHeader(name="x", dtype="F32", shape=[0], nbytes=0)}], None, ""),
        ([{"data": b"\x00" * 5, "digest": "sha256:00"}], None, ""),  # no header
        ([{"index": U32, "offset": U64, "data": b"abc"}], None, ""),  # largest values
        ([{"index": 7, "offset": 1 << 20, "data": bytearray(b"xyz")}], None, ""),
        ([{"index": 2, "offset": 3, "data": memoryview(b"0123456789")[2:7]}], None, ""),
        ([{"header": HEADER, "data": bytes(range(256)) * 600}], None, ""),  # 2-byte varints
        (
            [
                {"index": 0, "header": HEADER, "data": b"a", "digest": "sha256:1"},
                {"index": 1, "header": pb.SliceHeader(name="b"), "data": b""},
                {"index": 2, "header": HEADER, "data": b"\xff" * 200, "offset": 0},
                {"index": 2, "offset": 200, "data": b"\x01" * 3, "digest": "sha256:2"},
            ],
            pb.FetchDone(num_tensors=3, total_bytes=204),
            "",
        ),
    ],
)
def test_encoded_response_is_byte_identical_to_protobuf(
    chunks: list[dict[str, Any]], done: pb.FetchDone | None, fingerprint: str
) -> None:
    mine, theirs = _pair(chunks, done, fingerprint)
    assert mine == theirs
    assert pb.FetchResponse.FromString(mine).SerializeToString() == theirs
    for api in (server_wire._BYTES_API, None):  # written in place; joined where it cannot be
        with mock.patch.object(server_wire, "_BYTES_API", api):
            assert _pair(chunks, done, fingerprint, in_place=True)[0] == theirs


@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "index": st.integers(0, U32),
                "offset": st.integers(0, U64),
                "data": st.binary(max_size=300),
                "digest": st.text(max_size=20),
                "header": st.none()
                | st.builds(
                    pb.SliceHeader,
                    name=st.text(max_size=10),
                    shape=st.lists(st.integers(0, U64), max_size=3),
                    nbytes=st.integers(0, U64),
                ),
            }
        ),
        max_size=4,
    ),
    st.none() | st.builds(pb.FetchDone, num_tensors=st.integers(0, U32)),
    st.text(max_size=10),
)
@settings(max_examples=200, deadline=None)
def test_any_message_encodes_as_protobuf_does(
    chunks: list[dict[str, Any]], done: pb.FetchDone | None, fingerprint: str
) -> None:
    mine, theirs = _pair(chunks, done, fingerprint)
    assert mine == theirs
    assert _pair(chunks, done, fingerprint, in_place=True)[0] == theirs


@pytest.mark.parametrize("size", [0, 1, 2, 7, 1 << 20])
def test_writable_bytes_are_new_objects_filled_in_place(size: int) -> None:
    out, view = server_wire.writable_bytes(size)
    if size < 2:  # CPython shares b"" and one-byte objects: never written
        assert view is None
        return
    assert view is not None and view.nbytes == size and not view.readonly
    data = os.urandom(size)
    with view:
        view[:] = data
    assert type(out) is bytes and out == data and len(out) == size
    other, view2 = server_wire.writable_bytes(size)
    assert other is not out
    assert view2 is not None
    view2.release()


def test_a_failing_fill_leaves_no_message_and_nothing_else_runs() -> None:
    """The daemon checks a slice's digest inside its last fill: the message never exists."""
    calls: list[int] = []

    def ok(view: memoryview) -> None:
        calls.append(view.nbytes)
        view[:] = b"\x00" * view.nbytes

    def bad(view: memoryview) -> None:
        raise DataIntegrityError("tensor 't' in shard s: slice bytes read now hash to x")

    enc = EncodedResponse()
    enc.add_chunk_into(0, 0, 10, ok, header=HEADER)
    enc.add_chunk_into(0, 10, 5, bad, digest="sha256:00")
    enc.add_chunk_into(1, 0, 3, ok, header=HEADER, digest="sha256:11")
    assert enc.payload_bytes == 18 and not enc.empty
    with pytest.raises(DataIntegrityError, match="read now hash to"):
        enc.build()
    assert calls == [10]  # stopped at the failing piece
    with pytest.raises(DataIntegrityError):
        serialize_fetch_response(enc)  # nor can gRPC get it later


def test_encoder_refuses_out_of_range_fields() -> None:
    with pytest.raises(ValueError):
        EncodedResponse().add_chunk(U32 + 1, 0, b"")
    with pytest.raises(ValueError):
        EncodedResponse().add_chunk(-1, 0, b"")
    with pytest.raises(ValueError):
        EncodedResponse().add_chunk(0, -1, b"x")


def test_serializer_and_payload_count_take_either_kind_of_message() -> None:
    enc = EncodedResponse()
    assert enc.empty
    enc.add_chunk(0, 0, b"abcd", header=HEADER)
    enc.add_chunk(1, 0, b"", header=HEADER)
    assert not enc.empty
    assert payload_bytes(enc) == 4
    msg = pb.FetchResponse.FromString(serialize_fetch_response(enc))
    assert serialize_fetch_response(msg) == serialize_fetch_response(enc)
    assert payload_bytes(msg) == 4
    assert payload_bytes(pb.AdapterEvent()) == 0


def test_service_table_covers_every_method_of_the_proto() -> None:
    """``add_weights_service`` replaces the generated registration: it must not drift."""

    class Recorder:
        def __init__(self) -> None:
            self.registered: dict[str, Any] = {}

        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            self.generic = handlers

        def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
            self.registered[service] = handlers

    from weightd.server.registry.models import ModelRegistry
    from weightd.server.weights.service import WeightService

    rec = Recorder()
    add_weights_service(WeightsService(WeightService(ModelRegistry())), rec)  # type: ignore[arg-type]
    descriptor = pb.DESCRIPTOR.services_by_name["Weights"]
    assert descriptor.full_name == WEIGHTS_SERVICE
    handlers = rec.registered[WEIGHTS_SERVICE]
    assert set(handlers) == {m.name for m in descriptor.methods}
    for m in descriptor.methods:
        h = handlers[m.name]
        behavior = h.unary_stream if m.server_streaming else h.unary_unary
        assert behavior is not None and behavior.__name__ == m.name
        assert h.request_deserializer.__self__ is getattr(pb, m.input_type.name)
        reply = getattr(pb, m.output_type.name)()
        assert h.response_serializer(reply) == reply.SerializeToString()
        if m.name == "Fetch":
            assert h.response_serializer is serialize_fetch_response
