"""Reporting hashing progress: a redrawn bar on a terminal, periodic log lines otherwise.

Hashing a large checkpoint cold takes minutes; an operator watching a terminal wants
a bar, and a daemon under systemd or Kubernetes wants a log line every few seconds
(not thousands of carriage returns in its journal). Both are rate limited, so the
hashing threads that call :meth:`Reporter.advance` pay almost nothing.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Final, TextIO

log = logging.getLogger("weightd.hashing")

BAR_WIDTH: Final = 30
BAR_INTERVAL_S: Final = 0.2
LOG_INTERVAL_S: Final = 5.0


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def render_bar(label: str, done: int, total: int, elapsed: float) -> str:
    """One line of the terminal bar. Pure."""
    frac = done / total if total else 1.0
    filled = int(frac * BAR_WIDTH)
    rate = done / elapsed / 1e9 if elapsed > 0 else 0.0
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    return f"{label} [{bar}] {frac * 100:5.1f}% {_gib(done)}/{_gib(total)} {rate:.2f} GB/s"


class Reporter:
    """Receives (done, total) from hashing threads and shows it at a bounded rate."""

    def __init__(
        self,
        label: str,
        *,
        stream: TextIO | None = None,
        tty: bool | None = None,
        log_interval_s: float = LOG_INTERVAL_S,
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = BAR_INTERVAL_S if self.tty else log_interval_s
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last = self._start
        self._drawn = False

    def advance(self, done: int, total: int) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval and done < total:
                return
            self._last = now
            elapsed = now - self._start
            if self.tty:
                self.stream.write("\r" + render_bar(self.label, done, total, elapsed))
                self.stream.flush()
                self._drawn = True
            elif done < total:
                pct = done / total * 100 if total else 100.0
                log.info(
                    "%s: %s of %s (%.0f%%), %.2f GB/s",
                    self.label,
                    _gib(done),
                    _gib(total),
                    pct,
                    done / elapsed / 1e9 if elapsed > 0 else 0.0,
                )

    def close(self) -> None:
        with self._lock:
            if self._drawn:
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = False
