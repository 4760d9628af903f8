"""Cleanup that never hides the error it is cleaning up after.

A ``finally: resource.close()`` that raises replaces the exception in flight: a pack
build that failed on a changed shard (``DataIntegrityError``, DATA_LOSS naming the
shard) came out as ``BufferError: cannot close exported pointers exist`` (INTERNAL),
because the frames the failure unwound through still held views into the mapping
being closed. :func:`closing` is the one way the daemon runs such a step:

* on success the cleanup runs and its own error, if any, is raised (nothing failed
  before it, so it is the news);
* on failure the frames the error unwound through are cleared first (their locals —
  views, buffers — are what kept the resource busy), then the cleanup runs, and an
  error from it is logged and attached to the original as a note; the original error
  is what propagates.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Callable, Iterator

log = logging.getLogger("weightd.cleanup")


def release_frames(error: BaseException) -> None:
    """Drop the locals of the finished frames ``error`` unwound through.

    The traceback keeps its file/line entries; what goes are the references those
    frames held (memoryviews into a mapping, big byte strings), so a mapping can be
    unmapped and memory returns when the call ends, not at the next garbage collection.
    Frames still executing (the caller's) are left alone. The errors it was raised
    from or during (``__cause__``, ``__context__``; kept even under ``from None``) hold
    frames too, and are cleared the same way.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


def note(error: BaseException, text: str) -> None:
    """Attach ``text`` to ``error`` (``add_note`` where Python has it, 3.11+)."""
    add = getattr(error, "add_note", None)
    if add is not None:
        add(text)


@contextlib.contextmanager
def on_error(undo: Callable[[], object], what: str) -> Iterator[None]:
    """Run ``undo`` only if the block fails (a half-built resource), never raising over it."""
    try:
        yield
    except BaseException as error:
        release_frames(error)
        try:
            undo()
        except Exception as cleanup_error:
            log.warning("cleanup of %s failed after an error: %r", what, cleanup_error)
            note(error, f"cleanup of {what} also failed: {cleanup_error!r}")
        raise


@contextlib.contextmanager
def closing(close: Callable[[], object], what: str) -> Iterator[None]:
    """Run ``close`` when the block ends, without ever raising over the block's error."""
    with on_error(close, what):
        yield
    close()
