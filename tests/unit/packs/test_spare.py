"""Spare pack memory (``weightd.server.packs.spare``): bounded, allocated, zeroed, exact."""

from __future__ import annotations

import os

from weightd.common.hugemap import HUGE_PAGE
from weightd.server.packs.spare import SparePool, capacity_for


def _fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_size_classes_are_whole_huge_pages() -> None:
    assert capacity_for(1) == HUGE_PAGE
    assert capacity_for(HUGE_PAGE) == HUGE_PAGE
    assert capacity_for(HUGE_PAGE + 1) == 2 * HUGE_PAGE
    assert capacity_for(0) == HUGE_PAGE


def test_the_pool_is_off_unless_given_a_budget() -> None:
    pool = SparePool()
    assert pool.prepare([HUGE_PAGE]) == 0
    assert pool.prepare_in_background([HUGE_PAGE]) is None
    assert pool.take(HUGE_PAGE) is None


def test_the_budget_bounds_what_is_held_and_a_spare_is_allocated_and_zero() -> None:
    before = _fds()
    pool = SparePool(2 * HUGE_PAGE + HUGE_PAGE // 2)
    try:
        # three asked, two fit: memory held between publishes never exceeds the budget
        assert pool.prepare([HUGE_PAGE, HUGE_PAGE + 5, HUGE_PAGE]) == 2
        assert pool.held_bytes == 2 * HUGE_PAGE
        assert pool.take(3 * HUGE_PAGE) is None  # no spare of that class: a fresh build
        spare = pool.take(HUGE_PAGE - 100)
        assert spare is not None and spare.capacity == HUGE_PAGE
        try:
            st = os.fstat(spare.fd)
            assert st.st_size == HUGE_PAGE - 100  # truncated to the pack's exact size
            assert st.st_blocks * 512 >= HUGE_PAGE - 100  # allocated ahead, not on touch
            assert os.pread(spare.fd, HUGE_PAGE, 0) == bytes(HUGE_PAGE - 100)
        finally:
            os.close(spare.fd)
        other = pool.take(HUGE_PAGE)
        assert other is not None and other.fd != spare.fd
        os.close(other.fd)
        assert pool.taken_total == 2
        assert pool.take(HUGE_PAGE) is None  # each spare is handed out once
    finally:
        pool.close()
    assert pool.prepare([HUGE_PAGE]) == 0  # closed: nothing prepared after the daemon stops
    assert _fds() == before


def test_a_smaller_budget_frees_the_spares_beyond_it() -> None:
    before = _fds()
    pool = SparePool(2 * HUGE_PAGE)
    try:
        assert pool.prepare([HUGE_PAGE, HUGE_PAGE]) == 2
        pool.configure(HUGE_PAGE)
        assert pool.held_bytes == HUGE_PAGE
        pool.configure(0)
        assert pool.held_bytes == 0
    finally:
        pool.close()
    assert _fds() == before
