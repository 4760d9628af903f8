"""One set of bounds for every server stream, on every listener.

A server stream holds an RPC worker thread for as long as it runs, and whatever the
handler holds (a Fetch's buffers, a FetchAdapter's lease on an adapter version, a
watch's place in a queue) until it ends. Bounding only Fetch left FetchAdapter and the
watches free to run forever: a stalled FetchAdapter kept its lease past
``--max-stream-seconds`` and the next ``LoadAdapter`` was refused. So
:class:`StreamBounds` wraps every ``unary_stream``/``stream_stream`` handler, whatever
its service (Weights, health, reflection, admin):

* **at most ``max_streams`` at once** on the listener (beyond: RESOURCE_EXHAUSTED at
  once, with the reason): the listener's pool has threads left over for unary calls,
  so health ``Check`` and ``ListModels`` are answered however many streams are open;
* **duration**: a stream that keeps moving is stopped at ``--max-stream-seconds`` with
  DEADLINE_EXCEEDED and a reason; one that is blocked (in a ``yield`` gRPC cannot
  finish because the client stopped reading, or waiting for an event) is cancelled by
  :class:`StreamWatchdog` a few seconds later;
* **idle**: a stream whose client has not taken its last message for
  ``--stream-idle-seconds`` is cancelled: it holds a thread for nobody;
* **release**: the inner handler is closed when the stream ends for any reason, so
  its ``finally`` (leases, buffers) runs at that moment, not at a later collection.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import grpc

from ..base.errors import ResourceLimitError, StreamTimeLimit
from .interceptors import Behavior, Handler, rewrap, split_method
from .status import abort

log = logging.getLogger("weightd.streams")

#: Seconds past the cap before a blocked stream is cancelled (the polite path first).
DEFAULT_SLACK_SECONDS: Final = 5.0


class TooManyStreams(ResourceLimitError):
    """Every stream slot of a listener is taken."""


@dataclass
class _Stream:
    context: grpc.ServicerContext
    what: str
    started: float
    #: When the stream last handed a message to gRPC that gRPC has not taken back yet
    #: (the client has not read it); None while the handler is running.
    blocked_since: float | None = None
    cancelled: bool = field(default=False)


class StreamWatchdog:
    """Cancels streams past their duration cap (plus slack) or idle past ``idle_seconds``.

    A handler blocked in ``yield`` (the client stopped reading; flow control holds the
    send) or waiting for an event cannot check a clock itself, so one thread scans the
    live streams a few times a second. ``max_seconds`` or ``idle_seconds`` of 0 turn
    that bound off.
    """

    def __init__(
        self,
        max_seconds: float,
        slack_seconds: float = DEFAULT_SLACK_SECONDS,
        idle_seconds: float = 0.0,
    ) -> None:
        self.max_seconds = max_seconds
        self.slack_seconds = slack_seconds
        self.idle_seconds = idle_seconds
        bounds = [b for b in (slack_seconds, idle_seconds, max_seconds) if b > 0]
        self._interval = min([1.0, *(b / 4 for b in bounds)])
        self._cond = threading.Condition()
        self._live: dict[int, _Stream] = {}
        self._next = 0
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, context: grpc.ServicerContext, what: str) -> int:
        with self._cond:
            token = self._next
            self._next += 1
            self._live[token] = _Stream(context, what, time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="weightd-stream-watchdog", daemon=True
                )
                self._thread.start()
        return token

    def blocked(self, token: int) -> None:
        """The stream handed gRPC a message; the client has yet to take it."""
        with self._cond:
            stream = self._live.get(token)
            if stream is not None:
                stream.blocked_since = time.monotonic()

    def moving(self, token: int) -> None:
        """gRPC took the message; the handler runs again."""
        with self._cond:
            stream = self._live.get(token)
            if stream is not None:
                stream.blocked_since = None

    def release(self, token: int) -> None:
        with self._cond:
            self._live.pop(token, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _expired(self, stream: _Stream, now: float) -> str | None:
        """Why ``stream`` must be cancelled now, or None (called under the lock)."""
        if self.max_seconds > 0 and now - stream.started > self.max_seconds + self.slack_seconds:
            return f"ran past the {self.max_seconds:g}s stream limit (--max-stream-seconds)"
        since = stream.blocked_since
        if self.idle_seconds > 0 and since is not None and now - since > self.idle_seconds:
            return f"its client took no message for {self.idle_seconds:g}s (--stream-idle-seconds)"
        return None

    def _run(self) -> None:
        while True:
            doomed: list[tuple[_Stream, str]] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                for stream in self._live.values():
                    why = None if stream.cancelled else self._expired(stream, now)
                    if why is not None:
                        stream.cancelled = True
                        doomed.append((stream, why))
                if not doomed:
                    self._cond.wait(self._interval)
                    continue
            for stream, why in doomed:
                log.warning("%s %s; cancelling it", stream.what, why)
                stream.context.cancel()


class StreamBounds(grpc.ServerInterceptor):
    """Bounds every server stream of one listener (see the module docstring)."""

    def __init__(self, watchdog: StreamWatchdog | None, max_streams: int, listener: str) -> None:
        self._watchdog = watchdog
        self.max_streams = max_streams
        self.listener = listener
        self._lock = threading.Lock()
        self._open = 0

    @property
    def open_streams(self) -> int:
        with self._lock:
            return self._open

    @property
    def full(self) -> bool:
        """Every stream slot is taken: a new stream would be refused."""
        with self._lock:
            return self._open >= self.max_streams

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.unary_stream is None and handler.stream_stream is None:
            return handler  # single responses: not a stream to bound
        method = handler_call_details.method
        return rewrap(handler, lambda b: b, lambda b: self._bound(b, method))

    def _take(self, method: str) -> None:
        with self._lock:
            if self._open >= self.max_streams:
                raise TooManyStreams(
                    f"the {self.listener} listener has {self.max_streams} streams open "
                    f"already; {method} was refused (try again shortly)"
                )
            self._open += 1

    def _give(self) -> None:
        with self._lock:
            self._open -= 1

    def _bound(self, behavior: Behavior, method: str) -> Behavior:
        watchdog = self._watchdog
        _, name = split_method(method)

        def bounded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                self._take(method)
            except TooManyStreams as exc:
                abort(context, exc, name)
            token = None if watchdog is None else watchdog.watch(context, f"{name} stream")
            started = time.monotonic()
            inner = behavior(request, context)
            try:
                for response in inner:
                    if watchdog is not None and token is not None:
                        if 0 < watchdog.max_seconds < time.monotonic() - started:
                            abort(context, _past_cap(name, watchdog.max_seconds), name)
                        watchdog.blocked(token)
                        yield response
                        watchdog.moving(token)
                    else:
                        yield response
            finally:
                close = getattr(inner, "close", None)
                try:
                    if callable(close):
                        close()  # the handler's finally (leases, buffers) runs now
                finally:
                    if watchdog is not None and token is not None:
                        watchdog.release(token)
                    self._give()

        return bounded


def _past_cap(name: str, seconds: float) -> StreamTimeLimit:
    return StreamTimeLimit(
        f"{name} stream ran past the daemon's {seconds:g}s limit (--max-stream-seconds); "
        "ask for less per call (or watch again)"
    )
