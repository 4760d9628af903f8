"""The hand-written Fetch wire format: byte-identical to protobuf, parsed as protobuf does.

Server side (``weightd.server.rpc.wire``): every message it encodes must be exactly
``SerializeToString`` of the same ``FetchResponse``. Client side
(``weightd.client.fetchwire``): for any input, it must accept what protobuf accepts
with the same content, and refuse what protobuf refuses with ``DataLossError``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightd.client.errors import DataLossError
from weightd.client.fetchwire import WireResponse, from_message, parse_fetch_response
from weightd.client.receive import RankReceiver
from weightd.server.rpc import wire as server_wire
from weightd.server.rpc.weights import WeightsService, add_weights_service
from weightd.server.rpc.wire import (
    WEIGHTS_SERVICE,
    EncodedResponse,
    payload_bytes,
    serialize_fetch_response,
)
from weightd.v1 import weightd_pb2 as pb

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1

HEADER = pb.SliceHeader(
    name="model.layers.0.mlp.down_proj.weight",
    dtype="BF16",
    shape=[4096, 5632],
    nbytes=4096 * 5632 * 2,
    split_dim=1,
    replicated=False,
)


def _pair(
    chunks: list[dict[str, Any]], done: pb.FetchDone | None = None, fingerprint: str = ""
) -> tuple[bytes, bytes]:
    """(hand-encoded, protobuf-serialized) bytes of the same message."""
    enc = EncodedResponse()
    msg = pb.FetchResponse(model_fingerprint=fingerprint)
    for c in chunks:
        header = c.get("header")
        enc.add_chunk(
            c.get("index", 0),
            c.get("offset", 0),
            c.get("data", b""),
            header=header,
            digest=c.get("digest", ""),
        )
        piece = msg.chunks.add(
            index=c.get("index", 0),
            offset=c.get("offset", 0),
            data=bytes(c.get("data", b"")),
            digest=c.get("digest", ""),
        )
        if header is not None:
            piece.header.CopyFrom(header)
    if done is not None:
        enc.set_done(done)
        msg.done.CopyFrom(done)
    enc.set_fingerprint(fingerprint)
    return enc.serialize(), msg.SerializeToString()


# --- the server's encoder -----------------------------------------------------------------


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

    rec = Recorder()
    add_weights_service(WeightsService(ModelRegistry()), rec)  # type: ignore[arg-type]
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


# --- the client's parser ------------------------------------------------------------------


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


# --- the receiver, fed wire bytes -----------------------------------------------------------


class FakeStream:
    """A Fetch call's iterator of wire bytes; remembers whether it was cancelled."""

    def __init__(self, messages: list[bytes]) -> None:
        self._it = iter(messages)
        self.cancelled = False

    def __iter__(self) -> FakeStream:
        return self

    def __next__(self) -> bytes:
        return next(self._it)

    def cancel(self) -> None:
        self.cancelled = True


def _rank(payloads: list[bytes], per_message: int = 4) -> list[bytes]:
    """A daemon-shaped stream of uint8 tensors, ``per_message`` payload bytes a message."""
    first = EncodedResponse()
    first.set_fingerprint("fp")
    out = [first.serialize()]
    msg = EncodedResponse()
    for index, data in enumerate(payloads):
        header: pb.SliceHeader | None = pb.SliceHeader(
            name=f"t{index}", dtype="U8", shape=[len(data)], nbytes=len(data)
        )
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        pieces = [data[o : o + per_message] for o in range(0, len(data), per_message)] or [b""]
        offset = 0
        for i, piece in enumerate(pieces):
            if not msg.empty and msg.payload_bytes + len(piece) > per_message:
                out.append(msg.serialize())
                msg = EncodedResponse()
            last = i == len(pieces) - 1
            msg.add_chunk(index, offset, piece, header=header, digest=digest if last else "")
            header = None
            offset += len(piece)
    msg.set_done(pb.FetchDone(num_tensors=len(payloads), total_bytes=sum(map(len, payloads))))
    out.append(msg.serialize())
    return out


PAYLOADS = [b"0123456789", b"", b"abc", bytes(range(256)) * 3]


def test_receiver_assembles_tensors_from_wire_bytes_and_from_messages() -> None:
    raw = _rank(PAYLOADS)
    for stream in (FakeStream(raw), FakeStream([pb.FetchResponse.FromString(m) for m in raw])):
        r = RankReceiver()
        r.consume(stream)
        assert r.fingerprint == "fp"
        assert r.first is not None and r.first.model_fingerprint == "fp"
        got = {k: bytes(v.numpy().tobytes()) for k, v in r.tensors.items()}
        assert got == {f"t{i}": p for i, p in enumerate(PAYLOADS)}
        assert r.received_bytes == sum(map(len, PAYLOADS))


def _tampered(raw: list[bytes], old: bytes, new: bytes) -> list[bytes]:
    hit = [m.replace(old, new) for m in raw]
    assert hit != raw
    return hit


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda raw: _tampered(raw, b"abc", b"abd"), "hash to"),  # a payload changed
        (lambda raw: raw[:2] + raw[3:], "does not follow|arrived"),  # a message lost
        (lambda raw: raw[:-1], "ended before"),  # no done
        (lambda raw: [*raw, raw[-1]], "after closing"),
        (lambda raw: [raw[0], raw[1][:-1], *raw[2:]], "malformed"),  # a message cut short
        (lambda raw: [raw[0], b"\x0a\x02\x08\x05", *raw[1:]], "tensor 5 arrived"),
    ],
)
def test_receiver_refuses_damaged_streams_with_data_loss(mutate: Any, match: str) -> None:
    stream = FakeStream(mutate(_rank(PAYLOADS)))
    r = RankReceiver()
    with pytest.raises(DataLossError, match=match):
        r.consume(stream)
    assert set(r.tensors) <= {f"t{i}" for i in range(len(PAYLOADS))}
    for name, t in r.tensors.items():  # what was kept was complete and checked
        assert bytes(t.numpy().tobytes()) == PAYLOADS[int(name[1:])]


def test_receiver_reports_rpc_errors_and_keeps_complete_tensors() -> None:
    class Cut(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "daemon restarted"

    raw = _rank(PAYLOADS)

    def stream() -> Any:
        yield from raw[:4]
        raise Cut()

    r = RankReceiver()
    with pytest.raises(Exception, match="daemon restarted"):
        r.consume(stream())
    assert r.next_index >= 1
