"""A PublishTensors stream is read with a bound on the wait for each chunk (pure
iterators here; the daemon's request stream behaves the same: it blocks, or raises)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from weightd.server.base.errors import PublishAborted
from weightd.server.rpc.versions import paced_chunks


def test_every_chunk_in_order() -> None:
    assert list(paced_chunks(iter(range(10)), 30.0)) == list(range(10))


def test_a_stalled_stream_is_given_up() -> None:
    release = threading.Event()

    def stalled() -> Iterator[int]:
        yield 1
        release.wait(60)  # a trainer that stopped sending
        yield 2

    got = []
    with pytest.raises(PublishAborted, match=r"sent nothing for 0.2 s"):
        for x in paced_chunks(stalled(), 0.2):
            got.append(x)
    release.set()
    assert got == [1]


def test_a_broken_stream_is_an_abort() -> None:
    def broken() -> Iterator[int]:
        yield 1
        raise RuntimeError("the connection went away")

    with pytest.raises(PublishAborted, match="broke before all its bytes"):
        list(paced_chunks(broken(), 30.0))
