"""A watch RPC's stream (WatchAdapters, WatchVersions): a domain event queue, encoded.

The queue, its bound and what overflowing it means are :class:`weightd.common.watch.
EventQueue`'s; here, once for every watch, is what the wire adds: the poll that notices
a client gone (or the daemon stopping) while no event comes, the status a watcher that
fell too far behind receives, and the queue's ``close`` however the stream ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Final, TypeVar

import grpc

from weightd.common.watch import EventQueue

from ..base.errors import WatchOverflow
from .status import abort

#: Seconds between checks that a watcher is still connected (and holds' expiry).
WATCH_POLL_SECONDS: Final = 1.0

E = TypeVar("E")
R = TypeVar("R")


def watch_stream(
    events: EventQueue[E],
    context: grpc.ServicerContext,
    stop: threading.Event,
    encode: Callable[[E], R],
    method: str,
    what: str,
) -> Iterator[R]:
    """``events`` as ``method``'s messages until the client goes or ``stop`` is set;
    a watcher cut off for falling behind gets RESOURCE_EXHAUSTED naming ``what``."""

    def alive() -> bool:
        return context.is_active() and not stop.is_set()

    try:
        for event in events.events(alive, WATCH_POLL_SECONDS):
            yield encode(event)
        if events.overflowed and alive():
            overflow = WatchOverflow(f"watcher fell too far behind the {what} events; watch again")
            abort(context, overflow, method)
    finally:
        events.close()
