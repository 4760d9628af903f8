"""The benchmark's residency check: /proc/self/pagemap says mapped only when every page
is, and ``settle`` touches exactly the tensors it cannot prove resident."""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from pathlib import Path

import pytest
import torch

from bench.resident import PAGE, _scan_all_present, mapped, settle

PAGES = 64


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


@pytest.mark.parametrize("scan", [True, False], ids=["PAGEMAP_SCAN", "entries"])
def test_an_untouched_mapping_is_not_mapped_and_a_written_one_is(scan: bool) -> None:
    buf = mmap.mmap(-1, PAGES * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        addr = _address(buf)
        assert not mapped(fd, addr, PAGES * PAGE, scan=scan)
        for i in range(PAGES - 1):
            buf[i * PAGE] = 1
        # The first page is present, the last is not: the whole read decides, not the
        # cheap look at the first entry.
        assert mapped(fd, addr, PAGE, scan=scan)
        assert not mapped(fd, addr, PAGES * PAGE, scan=scan)
        buf[(PAGES - 1) * PAGE] = 1
        assert mapped(fd, addr, PAGES * PAGE, scan=scan)
        # A range that starts and ends inside pages covers those pages.
        assert mapped(fd, addr + 100, PAGES * PAGE - 200, scan=scan)
        assert mapped(fd, addr, 0, scan=scan)
    finally:
        os.close(fd)
        buf.close()


def test_the_kernel_here_answers_pagemap_scan() -> None:
    """The fast path is the one the benchmark runs on this kernel (6.7+), not the fallback."""
    buf = mmap.mmap(-1, PAGES * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        first = _address(buf) // PAGE
        version = re.match(r"(\d+)\.(\d+)", os.uname().release)
        assert version is not None, os.uname().release
        if (int(version[1]), int(version[2])) < (6, 7):
            pytest.skip(f"kernel {os.uname().release} predates PAGEMAP_SCAN")
        assert _scan_all_present(fd, first, first + PAGES - 1) is False
        buf[:] = b"\x01" * (PAGES * PAGE)
        assert _scan_all_present(fd, first, first + PAGES - 1) is True
    finally:
        os.close(fd)
        buf.close()


def test_settle_touches_only_what_is_not_mapped(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * (PAGES * PAGE // 256))
    lazy = torch.from_file(str(path), shared=False, size=PAGES * PAGE, dtype=torch.uint8)
    written = torch.ones(PAGES * PAGE, dtype=torch.uint8)  # every page written: present
    state = {"lazy": lazy, "written": written, "empty": torch.empty(0)}
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        # torch.from_file reads the file into its own memory or maps it, depending on
        # the build; either way the answer must agree with the kernel's before and after.
        lazy_before = mapped(fd, lazy.data_ptr(), lazy.numel())
        _, proven = settle(state, "resident")
        assert proven == written.numel() + (lazy.numel() if lazy_before else 0)
        assert mapped(fd, lazy.data_ptr(), lazy.numel())  # touched now
        _, proven_again = settle(state, "resident")
        assert proven_again == written.numel() + lazy.numel()
        assert settle(state, "touched")[1] == 0  # the old definition proves nothing
    finally:
        os.close(fd)


def test_a_fresh_file_mapping_is_touched_then_mapped(tmp_path: Path) -> None:
    path = tmp_path / "shard.bin"
    path.write_bytes(b"\x07" * (PAGES * PAGE))
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), PAGES * PAGE, flags=mmap.MAP_PRIVATE)
    view = torch.frombuffer(buf, dtype=torch.uint8)
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        assert not mapped(fd, view.data_ptr(), view.numel())
        seconds, proven = settle({"w": view}, "resident")
        assert proven == 0 and seconds > 0
        assert mapped(fd, view.data_ptr(), view.numel())
    finally:
        os.close(fd)
        del view
        buf.close()
