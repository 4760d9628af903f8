"""Cleanup never raises over the error it cleans up after; memory held by frames goes."""

from __future__ import annotations

import mmap
import os
import weakref

import pytest

from weightd.server.base.cleanup import closing, on_error


def _fill(into: memoryview) -> None:
    part = into[:16]  # a view a failing frame still holds
    part[0] = 1
    raise RuntimeError("shard changed")


def test_a_failing_body_surfaces_as_itself_and_the_mapping_is_closed() -> None:
    fd = os.memfd_create("cleanup-test")
    try:
        os.ftruncate(fd, 4096)
        writer = mmap.mmap(fd, 4096)
        with (
            pytest.raises(RuntimeError, match="shard changed"),
            closing(writer.close, "writer"),
            memoryview(writer) as view,
        ):
            _fill(view[:64])
        assert writer.closed
    finally:
        os.close(fd)


def test_the_plain_finally_it_replaces_would_have_masked_the_error() -> None:
    fd = os.memfd_create("cleanup-test")
    try:
        os.ftruncate(fd, 4096)
        writer = mmap.mmap(fd, 4096)
        with pytest.raises(BufferError):
            try:
                with memoryview(writer) as view:
                    _fill(view[:64])
            finally:
                writer.close()
    finally:
        os.close(fd)


def test_a_failing_cleanup_after_a_failure_is_a_note_not_the_error() -> None:
    def broken() -> None:
        raise OSError("close failed")

    with pytest.raises(ValueError, match="the real problem") as err, closing(broken, "the thing"):
        raise ValueError("the real problem")
    notes = getattr(err.value, "__notes__", None)
    if notes is not None:  # Python 3.11+
        assert any("cleanup of the thing also failed" in n for n in notes)


def test_a_failing_cleanup_after_success_is_raised() -> None:
    def broken() -> None:
        raise OSError("close failed")

    with pytest.raises(OSError, match="close failed"), closing(broken, "the thing"):
        pass


def test_on_error_runs_only_on_failure() -> None:
    ran: list[str] = []
    with on_error(lambda: ran.append("undo"), "x"):
        pass
    assert ran == []
    with pytest.raises(KeyError), on_error(lambda: ran.append("undo"), "x"):
        raise KeyError("k")
    assert ran == ["undo"]


class _Big:
    pass


def _hold_and_fail(big: _Big) -> None:
    raise RuntimeError("failed while holding it")


def test_frames_of_the_failure_let_go_of_what_they_held() -> None:
    big = _Big()
    ref = weakref.ref(big)
    caught: BaseException | None = None
    try:
        with on_error(lambda: None, "x"):
            _hold_and_fail(big)
    except RuntimeError as exc:
        caught = exc
    del big
    assert caught is not None  # the error (and its traceback) is still alive ...
    assert ref() is None  # ... but the frame that held the object no longer holds it
