"""The client's receiver (``weightd.client.receive``) fed wire bytes: whole tensors or DATA_LOSS."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tests.unit.client.wire_streams import PAYLOADS, FakeStream, _rank, _tampered
from weightd.client.errors import DataLossError
from weightd.client.receive import RankReceiver
from weightd.v1 import weightd_pb2 as pb


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


def _payloads_of(r: RankReceiver) -> dict[str, bytes]:
    return {k: bytes(v.numpy().tobytes()) for k, v in r.tensors.items()}


@pytest.mark.parametrize(
    ("asked", "kind", "named"),
    [
        ("blake3", "blake3", None),  # a new daemon honours the ask and names the kind
        ("blake3", "", None),  # an old daemon ignores the ask: SHA-256, nothing named
        ("", "", None),  # an old client's request: SHA-256 as always
        ("blake3", "sha256", "sha256"),  # a daemon may always fall back to SHA-256
    ],
)
def test_receiver_checks_the_digest_kind_the_stream_names(
    asked: str, kind: str, named: str | None
) -> None:
    r = RankReceiver(asked=asked)
    r.consume(FakeStream(_rank(PAYLOADS, kind=kind, named=named)))
    assert r.kind == (kind or "sha256")
    assert _payloads_of(r) == {f"t{i}": p for i, p in enumerate(PAYLOADS)}


def test_receiver_refuses_a_tampered_blake3_stream() -> None:
    raw = _tampered(_rank(PAYLOADS, kind="blake3"), b"abc", b"abd")
    r = RankReceiver(asked="blake3")
    with pytest.raises(DataLossError, match="hash to blake3:"):
        r.consume(FakeStream(raw))
    assert "t2" not in r.tensors


@pytest.mark.parametrize(
    ("asked", "kind", "named"),
    [
        ("", "blake3", None),  # a kind the client never asked for
        ("blake3", "blake3", "md5"),  # a kind nobody knows
        ("blake3", "blake3", ""),  # BLAKE3 digests in a stream that names none (SHA-256)
    ],
)
def test_receiver_refuses_digests_of_another_kind(asked: str, kind: str, named: str | None) -> None:
    r = RankReceiver(asked=asked)
    with pytest.raises(DataLossError, match=r"names slice digests|hash to sha256"):
        r.consume(FakeStream(_rank(PAYLOADS, kind=kind, named=named)))
    assert not r.tensors or all(len(p) == 0 for p in _payloads_of(r).values())
