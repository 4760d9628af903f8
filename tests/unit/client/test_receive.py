"""The client's receiver (``weightd.client.receive.stream``) fed wire bytes: whole tensors
or DATA_LOSS."""

from __future__ import annotations

import mmap
import os
from typing import Any

import grpc
import pytest
import torch

from tests.unit.client.wire_streams import PAYLOADS, FakeStream, _rank, _tampered
from weightd.client.base.errors import DataLossError
from weightd.client.receive import stream as receive
from weightd.client.receive.stream import POPULATE_MIN_BYTES, RankReceiver
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


BIG = [os.urandom(POPULATE_MIN_BYTES + 12_345), b"small", os.urandom(2 * POPULATE_MIN_BYTES)]


def test_big_tensors_arrive_bit_for_bit_into_pages_populated_chunk_by_chunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tensors from ``POPULATE_MIN_BYTES`` up have the pages each chunk fills populated
    just before it is copied in: whole pages inside that tensor only, same bytes."""
    real = receive.populate.call
    asked: list[tuple[int, int, int]] = []

    def spy(start: int, length: int, advice: int) -> int:
        asked.append((start, length, advice))
        return real(start, length, advice) if real is not None else 0

    monkeypatch.setattr(receive.populate, "call", spy)
    r = RankReceiver(asked="blake3")
    r.consume(FakeStream(_rank(BIG, per_message=1 << 18, kind="blake3")))
    assert _payloads_of(r) == {f"t{i}": p for i, p in enumerate(BIG)}
    spans = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in (r.tensors["t0"], r.tensors["t2"])]
    assert len(asked) >= (len(BIG[0]) + len(BIG[2])) // (1 << 18) - 2  # about one per chunk
    for start, length, advice in asked:
        assert advice == receive.MADV_POPULATE_WRITE
        assert start % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0 and length > 0
        assert any(lo <= start and start + length <= hi for lo, hi in spans)  # never t1's
    big = r.tensors["t0"]
    assert big.is_contiguous() and big.device.type == "cpu" and big.dtype == torch.uint8
    big[0] = big[0] ^ 0xFF  # an ordinary writable tensor
    assert big[0].item() == BIG[0][0] ^ 0xFF


def test_a_kernel_that_refuses_the_advice_gets_page_faults_and_the_same_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    def refuse(start: int, length: int, advice: int) -> int:
        calls.append(length)
        return -1  # EINVAL before Linux 5.14

    monkeypatch.setattr(receive.populate, "call", refuse)
    r = RankReceiver()
    r.consume(FakeStream(_rank(BIG, per_message=1 << 18)))
    assert _payloads_of(r) == {f"t{i}": p for i, p in enumerate(BIG)}
    assert len(calls) == 1  # asked once, then never again
    assert receive.populate.call is None


def test_tensors_received_in_place_are_not_populated(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(start: int, length: int, advice: int) -> int:
        raise AssertionError("the caller's tensor is already there")

    monkeypatch.setattr(receive.populate, "call", never)
    into = {"t0": torch.zeros(len(BIG[0]), dtype=torch.uint8)}
    r = RankReceiver(into=into)
    r.consume(FakeStream(_rank(BIG[:2], per_message=1 << 18)))
    assert r.tensors["t0"] is into["t0"]
    assert bytes(into["t0"].numpy().tobytes()) == BIG[0]


def test_a_big_tensor_with_one_flipped_byte_is_refused() -> None:
    raw = _rank(BIG, per_message=1 << 18, kind="blake3")
    hit = raw.copy()
    i = next(k for k, m in enumerate(raw) if BIG[2][1000:1016] in m)
    hit[i] = raw[i].replace(BIG[2][1000:1016], bytes(b ^ 1 for b in BIG[2][1000:1016]))
    r = RankReceiver(asked="blake3")
    with pytest.raises(DataLossError, match="tensor 't2': received bytes hash to blake3:"):
        r.consume(FakeStream(hit))
    assert _payloads_of(r) == {"t0": BIG[0], "t1": BIG[1]}  # the complete ones are kept


def test_a_big_tensor_cut_short_is_refused_and_resumed_from_its_start() -> None:
    raw = _rank(BIG, per_message=1 << 18)
    r = RankReceiver()
    with pytest.raises(DataLossError, match="ended before"):
        r.consume(FakeStream(raw[: len(raw) // 2]))
    assert r.next_index == 2  # t2 was in flight: dropped, t0 and t1 kept (checked)
    assert _payloads_of(r) == {"t0": BIG[0], "t1": BIG[1]}
    # The next stream starts at next_index: the daemon sends only what is missing.
    r.consume(FakeStream(_rank_from(BIG, r.next_index)))
    assert _payloads_of(r) == {f"t{i}": p for i, p in enumerate(BIG)}


def _rank_from(payloads: list[bytes], start: int) -> list[bytes]:
    """The stream a daemon sends for ``start_index=start``: tensors from ``start`` on."""
    full = _rank(payloads, per_message=1 << 18)
    out = [full[0]]
    for m in full[1:]:
        chunks = pb.FetchResponse.FromString(m)
        kept = pb.FetchResponse()
        kept.chunks.extend(c for c in chunks.chunks if c.index >= start)
        if chunks.HasField("done"):
            kept.done.CopyFrom(chunks.done)
        if kept.chunks or kept.HasField("done"):
            out.append(kept.SerializeToString())
    return out
