"""When does a worker hold its weights? Every page of them in its page table.

A loader may hand back lazily mapped tensors whose pages are not yet in the process;
the first forward pass or a copy to the GPU would pay for those faults. The benchmark
makes every case pay for them before the clock stops, and asks the kernel
(``/proc/self/pagemap``) which tensors are mapped already, so that a loader that made
its pages resident itself (a populated shared pack, a private copy it wrote) is not
charged for reading memory that is already in place.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import time

import numpy as np
import torch

PAGE = 4096


def _touch_one(t: torch.Tensor) -> int:
    """Read one byte of every page of ``t``."""
    flat = t.reshape(-1).view(torch.uint8)
    return int(flat[::PAGE].sum())


#: ``PAGEMAP_SCAN`` (Linux 6.7, <linux/fs.h>): _IOWR('f', 16, struct pm_scan_arg).
PAGEMAP_SCAN = (3 << 30) | (96 << 16) | (ord("f") << 8) | 16
PAGE_IS_PRESENT = 1 << 3


class _ScanArg(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


def _scan_all_present(pagemap: int, first: int, last: int) -> bool | None:
    """Ask the kernel for the first page in [first, last] pages that is not present.

    One ioctl, whose walk skips a 2 MiB mapping in one step, where reading the entries
    costs 8 bytes per 4 KiB page (milliseconds for a rank of half a GiB in huge pages,
    which at TP=4 compete with the other ranks' fetches). None: the kernel has no PAGEMAP_SCAN.
    """
    regions = (ctypes.c_uint64 * 3)()  # one struct page_region: start, end, categories
    arg = _ScanArg(
        size=ctypes.sizeof(_ScanArg),
        start=first * PAGE,
        end=(last + 1) * PAGE,
        vec=ctypes.addressof(regions),
        vec_len=1,
        max_pages=1,
        category_inverted=PAGE_IS_PRESENT,  # match pages whose "present" is 0
        category_mask=PAGE_IS_PRESENT,
        return_mask=PAGE_IS_PRESENT,
    )
    try:
        found = fcntl.ioctl(pagemap, PAGEMAP_SCAN, arg)
    except OSError as exc:
        if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    if arg.walk_end < arg.end and found == 0:
        return None  # stopped early without an answer: let the entries decide
    return found == 0


def mapped(pagemap: int, address: int, size: int, *, scan: bool = True) -> bool:
    """Whether every page of [address, address + size) is in this process's page table.

    Bit 63 of each 8-byte ``/proc/self/pagemap`` entry is "present" (readable without
    privileges; only the frame numbers are hidden), and ``PAGEMAP_SCAN`` asks the same
    of the kernel in one call (``scan``, where the kernel has it). Neither faults
    anything in, so they prove a page was resident before it is read. A swapped page is
    not present: it would be faulted in on first use, like a lazy mapping.
    """
    if size <= 0:
        return True
    first, last = address // PAGE, (address + size - 1) // PAGE
    if scan:
        answer = _scan_all_present(pagemap, first, last)
        if answer is not None:
            return answer
    if not os.pread(pagemap, 8, first * 8)[7] & 0x80:  # cheap "no" for lazy mappings
        return False
    count = last - first + 1
    raw = os.pread(pagemap, count * 8, first * 8)
    if len(raw) != count * 8:
        return False
    entries = np.frombuffer(raw, dtype=np.uint64)
    return bool(((entries >> np.uint64(63)) == 1).all())


def settle(state: dict[str, torch.Tensor], until: str) -> tuple[float, int]:
    """Make every page of every tensor resident; the seconds that took, and the bytes
    the kernel already showed resident.

    A tensor is read page by page, unless ``until="resident"`` and the kernel shows all
    its pages mapped (``until="touched"``: every tensor, the benchmark's old definition).
    A tensor proven mapped is resident already, and reading its pages again
    measures memory latency, which every case pays when it uses its weights. The
    checks are not counted in the seconds, only the touches are.
    """
    check = until == "resident"
    spent, proven = 0.0, 0
    with open("/proc/self/pagemap", "rb", buffering=0) as f:
        for t in state.values():
            nbytes = t.numel() * t.element_size()
            cpu = t.device.type == "cpu"
            if cpu and not nbytes:
                continue
            if check and cpu and t.is_contiguous() and mapped(f.fileno(), t.data_ptr(), nbytes):
                proven += nbytes
                continue
            started = time.monotonic()
            if not cpu:
                torch.cuda.synchronize(t.device)  # GPU tensors are resident once the copy ends
            else:
                _touch_one(t)
            spent += time.monotonic() - started
    return spent, proven
