"""libc's memory-mapping calls, typed once for the process (ctypes, errno kept).

Why here: the client (aligned pack mappings) and the daemon (aligned pack writers,
page-cache residency with ``mincore``) need the same few calls with the same
argument types; a wrong ``restype`` truncates a 64-bit address silently.
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    """The process's libc with ``mmap``, ``munmap``, ``madvise`` and ``mincore`` typed.

    Raises ``OSError`` where there is no C library to load, ``AttributeError`` where
    it lacks one of the calls (not Linux).
    """
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.madvise.restype = ctypes.c_int
    lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    lib.mincore.restype = ctypes.c_int
    lib.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return lib
