"""Detecting whether packs may use shmem huge pages (``weightd.server.packs.hugepages``)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from tests.smaps import pmd_mapped_bytes
from weightd.common.hugemap import HUGE_PAGE, map_aligned
from weightd.server.packs.build import PACK_SEALS
from weightd.server.packs.hugepages import (
    RATE_WARMUP_BLOCKS,
    advise_and_allocate,
    allocate_by_advice,
    allocate_pack,
    collapse,
    collapse_sealed,
    parse_mode,
    read_mode,
    shmem_mode,
)


@pytest.mark.parametrize(
    ("text", "mode", "by_advice"),
    [
        ("always within_size advise [never] deny force\n", "never", False),
        ("always within_size [advise] never deny force\n", "advise", True),
        ("[always] within_size advise never deny force\n", "always", False),
        ("always [within_size] advise never\n", "within_size", False),
        ("always within_size advise never [deny] force\n", "deny", False),
        ("", "never", False),  # nothing selected: no huge pages
    ],
)
def test_mode_table(text: str, mode: str, by_advice: bool) -> None:
    assert parse_mode(text) == mode
    assert allocate_by_advice(mode) is by_advice


def test_unreadable_setting_means_no_huge_pages(tmp_path: Path) -> None:
    assert shmem_mode(str(tmp_path / "absent")) == "never"
    path = tmp_path / "shmem_enabled"
    path.write_text("always within_size [advise] never deny force\n")
    assert shmem_mode(str(path)) == "advise"


def test_allocation_by_advice_allocates_every_page() -> None:
    size = 4 << 20
    fd = os.memfd_create("test-advise", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        writer = map_aligned(fd, size, shared=True)
        advise_and_allocate(writer)  # this kernel may refuse huge pages; never the pages
        assert os.fstat(fd).st_blocks * 512 >= size  # allocated now, not on first touch
        writer[:4] = b"abcd"
        assert os.pread(fd, 4, 0) == b"abcd"
    finally:
        os.close(fd)


def test_read_mode_reads_the_file_again_every_time(tmp_path: Path) -> None:
    path = tmp_path / "shmem_enabled"
    assert read_mode(str(path)) == "never"  # absent: no THP in the kernel
    path.write_text("always within_size [advise] never deny force\n")
    assert read_mode(str(path)) == "advise"
    path.write_text("always within_size advise [never] deny force\n")
    assert read_mode(str(path)) == "never"


def test_a_sealed_pack_collapsed_later_keeps_its_bytes_and_its_seals() -> None:
    """The upgrade runs while clients map the pack: it must change nothing they can see,
    and claim only what the kernel did (smaps through an aligned mapping)."""
    size = 3 * HUGE_PAGE + 4096  # a tail that is not a whole block stays 4 KiB
    fd = os.memfd_create("test-collapse-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        data = bytes(range(256)) * (size // 256)
        os.ftruncate(fd, size)
        os.pwrite(fd, data, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, PACK_SEALS)
        client = map_aligned(fd, size, shared=False)  # a reader mapped before the upgrade
        before = bytes(client)
        done = collapse_sealed(fd, size, lambda: False)
        assert done % HUGE_PAGE == 0 and done <= 3 * HUGE_PAGE
        assert bytes(client) == before == data
        assert os.pread(fd, size, 0) == data
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == PACK_SEALS
        if done:
            assert pmd_mapped_bytes(fd, size) >= done
    finally:
        os.close(fd)


def test_a_collapse_asked_to_stop_stops_before_the_first_block() -> None:
    fd = os.memfd_create("test-collapse-stop", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 2 * HUGE_PAGE)
        os.posix_fallocate(fd, 0, 2 * HUGE_PAGE)
        assert collapse_sealed(fd, 2 * HUGE_PAGE, lambda: True) == 0
    finally:
        os.close(fd)


def test_a_collapse_slower_than_its_floor_stops_once_judged() -> None:
    """No kernel collapses at a petabyte per second: past the warm-up blocks the collapse
    stops; the rest is left to 4 KiB pages (and the upgrade after the build)."""
    blocks = RATE_WARMUP_BLOCKS + 8
    size = blocks * HUGE_PAGE
    fd = os.memfd_create("test-collapse-rate", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        writer = map_aligned(fd, size, shared=True)
        assert collapse(fd, writer, 1, min_rate=1e15) <= RATE_WARMUP_BLOCKS * HUGE_PAGE
    finally:
        os.close(fd)


def test_a_build_that_defers_part_of_its_collapse_still_allocates_every_page() -> None:
    size = (RATE_WARMUP_BLOCKS + 8) * HUGE_PAGE
    fd = os.memfd_create("test-collapse-defer", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        writer = map_aligned(fd, size, shared=True)
        huge, complete = allocate_pack(writer, fd, size, "never", 1, defer_collapse=True)
        assert os.fstat(fd).st_blocks * 512 >= size  # a shortage fails here, never later
        assert huge or not complete  # complete: every block collapsed, so it is huge
        if huge:
            assert 2 * pmd_mapped_bytes(fd, size) >= size
    finally:
        os.close(fd)
