"""Aligned memfd mappings (``weightd.common.hugemap``) and collapsing packs into huge pages."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch

from tests.smaps import pmd_mapped
from weightd.common.hugemap import HUGE_PAGE, address, madvise, map_aligned
from weightd.server.packs.hugepages import COLLAPSE, collapse, collapse_on_request


def _memfd(size: int) -> int:
    fd = os.memfd_create("test-hugemap", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def _mapped(start: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.startswith(f"{start:x}-") for line in f)


@pytest.mark.parametrize("size", [1, 4096, 3 * HUGE_PAGE + 12345])
def test_mapping_is_aligned_and_goes_with_its_last_user(size: int) -> None:
    fd = _memfd(size)
    try:
        mapping = map_aligned(fd, size, shared=False)
        start = address(mapping)
        assert start % HUGE_PAGE == 0 and len(mapping) == size and _mapped(start)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        del mapping
        gc.collect()
        assert _mapped(start)  # the tensor still views it
        assert int(tensor.sum()) == 0
        del tensor
        gc.collect()
        assert not _mapped(start)
    finally:
        os.close(fd)


def test_private_writes_stay_private_and_shared_writes_reach_the_file() -> None:
    fd = _memfd(8192)
    try:
        private = map_aligned(fd, 8192, shared=False)
        private[0:4] = b"mine"
        assert os.pread(fd, 4, 0) == b"\0" * 4
        shared = map_aligned(fd, 8192, shared=True)
        shared[100:104] = b"file"
        assert os.pread(fd, 4, 100) == b"file"
    finally:
        os.close(fd)


def test_bad_sizes_and_descriptors_are_errors_not_crashes() -> None:
    with pytest.raises(OSError) as err:
        map_aligned(0, 0, shared=False)
    assert err.value.errno == errno.EINVAL
    r, w = os.pipe()
    try:
        with pytest.raises(OSError, match="mapping 4096 bytes of descriptor"):
            map_aligned(r, 4096, shared=False)
    finally:
        os.close(r)
        os.close(w)


def test_madvise_refusal_is_an_oserror() -> None:
    fd = _memfd(4096)
    try:
        mapping = map_aligned(fd, 4096, shared=False)
        with pytest.raises(OSError, match=r"madvise\(12345\)"):
            madvise(mapping, 12345)
    finally:
        os.close(fd)


def test_only_never_collapses() -> None:
    assert collapse_on_request("never")
    assert {"never"} == COLLAPSE
    for mode in ("always", "within_size", "advise", "deny", "force"):
        assert not collapse_on_request(mode)


def test_collapse_reports_exactly_what_the_kernel_maps_huge() -> None:
    """Whole blocks only; the tail stays 4 KiB; the count is what smaps shows mapped huge."""
    size = 4 * HUGE_PAGE + 8192
    fd = _memfd(size)
    try:
        writer = map_aligned(fd, size, shared=True)
        done = collapse(fd, writer, 2)
        assert done % HUGE_PAGE == 0 and done <= 4 * HUGE_PAGE
        os.posix_fallocate(fd, 0, size)
        writer[size - 3 :] = b"end"
        reader = map_aligned(fd, size, shared=False)
        madvise(reader, 22)  # MADV_POPULATE_READ
        assert pmd_mapped(reader) == done
        assert bytes(reader[size - 3 :]) == b"end" and bytes(reader[:4]) == b"\0" * 4
    finally:
        os.close(fd)
