"""Detecting whether packs may use shmem huge pages (``weightd.server.packs.hugepages``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from weightd.common.hugemap import map_aligned
from weightd.server.packs.hugepages import (
    advise_and_allocate,
    allocate_by_advice,
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
