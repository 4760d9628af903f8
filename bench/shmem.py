"""The host's shmem huge-page mode, read and (as root) set for a benchmark.

Rank packs are memfds, so whether they get huge pages is the host-wide
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` (``packs/hugepages.py``). A
benchmark that compares modes in one run sets it around each measurement and puts
the original value back, whatever happens in between.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from weightd.server.packs.hugepages import SHMEM_ENABLED, read_mode

__all__ = ["SHMEM_ENABLED", "can_set_modes", "host_mode", "host_mode_set", "set_host_mode"]


def host_mode() -> str:
    """The current mode, read again on every call (a benchmark changes it)."""
    return read_mode(SHMEM_ENABLED)


def set_host_mode(mode: str) -> None:
    with open(SHMEM_ENABLED, "w") as f:
        f.write(mode)


def can_set_modes() -> bool:
    """Whether this process may change the mode (root and a writable sysfs)."""
    return os.access(SHMEM_ENABLED, os.W_OK)


@contextmanager
def host_mode_set(mode: str) -> Iterator[None]:
    """Run the block with ``shmem_enabled`` at ``mode``; the previous value comes back."""
    original = host_mode()
    if mode == original:
        yield
        return
    set_host_mode(mode)
    try:
        yield
    finally:
        set_host_mode(original)
