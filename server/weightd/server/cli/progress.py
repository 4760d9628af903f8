"""``weightd fetch``'s progress on a terminal: what it is doing, and tensors received.

A rank of a large model takes seconds over gRPC (and writing it out takes more): a
silent terminal for that long reads as a hang. On a terminal one line on stderr is
redrawn (at most every 0.1 s) and cleared at the end, so stdout keeps only the result
line; off a terminal nothing is drawn unless asked (``--progress always``).
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import Final, TextIO

REDRAW_SECONDS: Final = 0.1


class FetchProgress:
    """A redrawn status line; a no-op when not shown."""

    def __init__(self, label: str, *, stream: TextIO | None = None, show: bool = True) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.show = show
        self._lock = threading.Lock()
        self._last = 0.0
        self._width = 0
        self._tensors = 0

    @classmethod
    def for_mode(cls, mode: str, label: str, stream: TextIO | None = None) -> FetchProgress:
        """``mode``: ``auto`` (shown when the stream is a terminal), ``always``, ``never``."""
        out = stream if stream is not None else sys.stderr
        show = mode == "always" or (mode == "auto" and out.isatty())
        return cls(label, stream=out, show=show)

    def __enter__(self) -> FetchProgress:
        self.step("connecting")
        return self

    def tensor(self, index: int, name: str) -> None:
        """A tensor arrived (``WeightClient``'s ``on_tensor``; any thread)."""
        with self._lock:
            self._tensors = max(self._tensors, index + 1)
        self.step(f"{self._tensors} tensors received, last {name}", force=False)

    def step(self, what: str, *, force: bool = True) -> None:
        if not self.show:
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last < REDRAW_SECONDS:
                return
            self._last = now
            line = f"weightd fetch: {what} ({self.label})"[:160]  # what first: the label is long
            pad = " " * max(0, self._width - len(line))
            self.stream.write(f"\r{line}{pad}")
            self.stream.flush()
            self._width = len(line)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.show and self._width:
            with self._lock:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
