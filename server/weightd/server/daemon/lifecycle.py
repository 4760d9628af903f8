"""Signals and the graceful drain.

SIGTERM (or SIGINT) once: health turns NOT_SERVING, every listener refuses new RPCs,
RPCs in flight get up to the grace period to finish, then whatever is left (health
``Watch`` streams, stragglers) is cancelled and the daemon exits 0. A second signal
cancels everything at once and the daemon exits 1. A signal while models are still
being verified stops start-up at once (nothing is served yet): exit 128 + the signal.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Protocol

import grpc
from grpc_health.v1 import health

from ..rpc.interceptors import InflightTracker
from ..telemetry import logs

log = logging.getLogger("weightd")

#: How often a drain looks at the abort flag while waiting for RPCs to finish.
_POLL_SECONDS = 0.2


class ShutdownRequested(BaseException):
    """Raised in the main thread by the first signal while the daemon is starting."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class Signals:
    """Counts SIGTERM/SIGINT. Handlers only set flags (or raise during start-up)."""

    def __init__(self) -> None:
        self.count = 0
        self._first = threading.Event()
        self._starting = True

    @classmethod
    def install(cls) -> Signals:
        signals = cls()
        signal.signal(signal.SIGTERM, signals._on_signal)
        signal.signal(signal.SIGINT, signals._on_signal)
        return signals

    @property
    def aborted(self) -> bool:
        return self.count >= 2

    def started(self) -> None:
        """From now on the first signal drains instead of stopping start-up."""
        self._starting = False

    def wait(self) -> None:
        """Block until the first signal (in short waits, so handlers run promptly)."""
        while not self._first.wait(0.5):
            pass

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1:
            self._first.set()
            if self._starting:
                raise ShutdownRequested(signum)
        elif self.count == 2:
            log.warning("signal %d again: aborting in-flight RPCs now", signum)


class Drainable(Protocol):
    """What a drain needs of a daemon: its health, its servers, what is in flight."""

    @property
    def health(self) -> health.HealthServicer: ...
    @property
    def tracker(self) -> InflightTracker: ...
    @property
    def grpc_servers(self) -> list[grpc.Server]: ...
    def close(self) -> None: ...


def drain(daemon: Drainable, grace: float, signals: Signals) -> int:
    """Drain as described above; returns the exit status."""
    daemon.health.enter_graceful_shutdown()
    # stop(grace) refuses new RPCs at once and lets those in flight run; it would
    # cancel them itself after ``grace``, but it waits the whole grace for endless
    # health Watch streams too, so the tracker decides when everything real is done.
    for server in daemon.grpc_servers:
        server.stop(grace)
    # Logged once new RPCs are already refused: the line means "draining now".
    logs.event("drain", grace_seconds=grace, in_flight=daemon.tracker.count)
    deadline = time.monotonic() + grace
    while not signals.aborted:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or daemon.tracker.wait_idle(min(_POLL_SECONDS, remaining)):
            break
    left = daemon.tracker.count
    if left:
        log.warning("drain: cancelling %d RPC(s) still in flight", left)
    for event in [server.stop(0) for server in daemon.grpc_servers]:
        event.wait()
    daemon.close()
    return 1 if signals.aborted else 0
