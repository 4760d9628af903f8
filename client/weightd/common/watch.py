"""Watch streams, written once for both sides: the daemon's event queue, the client's stream.

Every watch (adapters, model versions) has the same two halves. In the daemon, each
watcher gets a bounded, ordered queue (:class:`EventQueue`): an event that finds it
full cuts the watcher off (``overflowed``) rather than letting one slow client make the
daemon keep events without bound; the watcher is told to watch again once it has read
what was queued before the cut. In the client, a watch is a server stream read as an
iterator of events (:class:`EventStream`) that ``close()`` (or ``with``) ends by
cancelling the call. Neither half imports gRPC: what a stream's failure means is the
caller's to say (the client's ``base/errors.py``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar

E = TypeVar("E")
M = TypeVar("M")
M_co = TypeVar("M_co", covariant=True)
#: ``typing.Self`` is Python 3.11+; the package supports 3.10.
S = TypeVar("S", bound="EventStream[Any, Any]")


class EventQueue(Generic[E]):
    """One watcher's pending events, at most ``limit``; see the module docstring.

    ``on_overflow`` runs (once, on the thread that put the event) when the queue is cut
    off: the event source stops delivering to it there. :meth:`close` ends it; a reader
    polls it with :meth:`events`.
    """

    def __init__(self, limit: int, on_overflow: Callable[[], None] | None = None) -> None:
        #: None: the wake-up :meth:`close` leaves for a reader blocked in :meth:`next`.
        self._queue: queue.Queue[E | None] = queue.Queue(limit)
        self._on_overflow = on_overflow
        self._ended = threading.Event()
        self.overflowed = False

    def put(self, event: E) -> None:
        """Queue ``event``, or cut the watcher off when it is ``limit`` events behind."""
        if self.overflowed or self._ended.is_set():
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.overflowed = True
            if self._on_overflow is not None:
                self._on_overflow()

    def next(self, timeout: float | None = None) -> E | None:
        """The next event; None on timeout, or once closed or cut off and drained."""
        if (self.overflowed or self._ended.is_set()) and self._queue.empty():
            return None
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """No more events: a reader waiting in :meth:`next` returns None now.

        A watch that registered itself with an event source extends this to leave it."""
        self._ended.set()
        # A full queue wakes its reader anyway; the ``next`` after those events sees the end.
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)

    def events(self, alive: Callable[[], bool], poll_seconds: float) -> Iterator[E]:
        """Events in order while ``alive()`` (asked every ``poll_seconds`` at least) and
        the queue is neither closed nor cut off; afterwards ``overflowed`` says whether
        the watcher fell too far behind."""
        while alive():
            event = self.next(timeout=poll_seconds)
            if event is not None:
                yield event
            elif self.overflowed or self._ended.is_set():
                return


class Call(Protocol[M_co]):
    """A server stream as gRPC's client returns it: its messages, and ``cancel``."""

    def __iter__(self) -> Iterator[M_co]: ...

    def cancel(self) -> bool: ...


class EventStream(Generic[M, E]):
    """A watch stream's messages as events (``convert``); ``close()`` (or ``with``) ends it.

    ``failed`` maps an error the stream raised to the error to raise instead (itself: as
    it is), or to None where it only says the stream was ended (cancelled by
    :meth:`close`).
    """

    def __init__(
        self,
        call: Call[M],
        convert: Callable[[M], E],
        failed: Callable[[Exception], Exception | None],
    ) -> None:
        self._call = call
        self._convert = convert
        self._failed = failed

    def close(self) -> None:
        """End the watch (the daemon's stream is cancelled; iteration stops)."""
        self._call.cancel()

    def __iter__(self) -> Iterator[E]:
        messages: Iterable[M] = self._call
        try:
            for message in messages:
                yield self._convert(message)
        except Exception as exc:
            error = self._failed(exc)
            if error is None:
                return
            if error is exc:
                raise
            raise error from None

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
