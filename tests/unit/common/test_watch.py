"""The one watch-stream code of both sides: the daemon's bounded queue, the client's stream."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from weightd.common.watch import EventQueue, EventStream


def test_a_watcher_that_falls_behind_is_cut_off_and_reads_what_was_queued_first() -> None:
    cut: list[str] = []
    q = EventQueue[int](2, lambda: cut.append("unregistered"))
    for event in range(5):
        q.put(event)
    assert q.overflowed and cut == ["unregistered"]  # told once, at the first event lost
    assert [q.next(timeout=0), q.next(timeout=0), q.next(timeout=0)] == [0, 1, None]


def test_events_stop_after_an_overflow_and_say_so() -> None:
    q = EventQueue[str](1)
    q.put("a")
    q.put("b")
    assert list(q.events(lambda: True, 0.01)) == ["a"]
    assert q.overflowed


def test_events_stop_when_the_reader_is_gone() -> None:
    q = EventQueue[str](4)
    q.put("a")
    assert list(q.events(lambda: False, 0.01)) == []
    assert not q.overflowed


def test_close_wakes_a_reader_blocked_without_a_timeout() -> None:
    q = EventQueue[str](4)
    got: list[str | None] = []
    reader = threading.Thread(target=lambda: got.append(q.next()))
    reader.start()
    q.close()
    reader.join(timeout=10)
    assert not reader.is_alive() and got == [None]
    q.put("late")  # nobody reads a closed watch: not queued
    assert q.next(timeout=0) is None


def test_a_closed_watch_still_hands_out_what_it_queued_before() -> None:
    q = EventQueue[str](4)
    q.put("a")
    q.close()
    assert list(q.events(lambda: True, 0.01)) == ["a"]


class Cancelled(Exception):
    pass


class Refused(Exception):
    pass


class Stream:
    """A server stream: messages, then an error or the end; ``cancel`` ends it."""

    def __init__(self, messages: list[int], error: Exception | None = None) -> None:
        self.messages, self.error, self.cancelled = messages, error, False

    def __iter__(self) -> Iterator[int]:
        for m in self.messages:
            if self.cancelled:
                raise Cancelled()
            yield m
        if self.error is not None:
            raise self.error

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def failed(error: Exception) -> Exception | None:
    if isinstance(error, Cancelled):
        return None
    if isinstance(error, Refused):
        return ValueError(f"typed: {error}")
    return error


def test_a_stream_converts_each_message_and_ends_quietly_when_closed() -> None:
    call = Stream([1, 2, 3])
    with EventStream(call, str, failed) as stream:
        events = iter(stream)
        assert next(events) == "1"
        stream.close()
        assert list(events) == []
    assert call.cancelled


def test_a_stream_error_becomes_the_typed_one_and_others_pass_unchanged() -> None:
    with pytest.raises(ValueError, match="typed: no"):
        list(EventStream(Stream([1], Refused("no")), str, failed))
    with pytest.raises(KeyError):
        list(EventStream(Stream([], KeyError("k")), str, failed))
