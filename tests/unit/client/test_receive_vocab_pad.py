"""A stream must confirm the ``vocab_pad`` its request asked for, in its first message."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from weightd.client import DataLossError, VocabPadUnsupportedError
from weightd.client.receive.stream import RankReceiver
from weightd.v1 import weightd_pb2 as pb


class _Stream:
    """Messages as a gRPC stream yields them; records whether the client cancelled it."""

    def __init__(self, messages: list[pb.FetchResponse]) -> None:
        self.messages = messages
        self.cancelled = False
        self.taken = 0

    def __iter__(self) -> Iterator[pb.FetchResponse]:
        for m in self.messages:
            self.taken += 1
            yield m

    def cancel(self) -> None:
        self.cancelled = True


def _messages(named: int) -> list[pb.FetchResponse]:
    header = pb.SliceHeader(name="lm_head.weight", dtype="U8", shape=[2], nbytes=2)
    return [
        pb.FetchResponse(model_fingerprint="fp", vocab_pad=named),
        pb.FetchResponse(
            chunks=[pb.TensorChunk(index=0, header=header, data=b"ab")],  # never reached
            done=pb.FetchDone(num_tensors=1, total_bytes=2),
        ),
    ]


def test_an_old_daemon_naming_nothing_is_refused_before_any_tensor() -> None:
    stream = _Stream(_messages(0))
    receiver = RankReceiver(vocab_pad=64)
    with pytest.raises(VocabPadUnsupportedError, match="asked for vocab_pad 64") as err:
        receiver.consume(stream)
    assert err.value.code.name == "FAILED_PRECONDITION"
    assert stream.cancelled and stream.taken == 1 and not receiver.tensors


def test_a_daemon_naming_another_padding_is_data_loss() -> None:
    stream = _Stream(_messages(128))
    with pytest.raises(DataLossError, match="names vocab_pad 128; the client asked for 64"):
        RankReceiver(vocab_pad=64).consume(stream)
    assert stream.cancelled


def test_a_request_without_vocab_pad_refuses_a_stream_that_names_one() -> None:
    with pytest.raises(DataLossError, match="names vocab_pad 64; the client asked for 0"):
        RankReceiver().consume(_Stream(_messages(64)))
