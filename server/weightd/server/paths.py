"""Confining file names from untrusted JSON to a model root, and opening them safely.

``weight_map`` values come from a file anyone could have written; ``Path(root) / name``
happily returns ``/etc/passwd`` for an absolute name. Names are checked as strings
first (pure), then the opened file is checked again by what the kernel says it is,
so a symlink that leaves the root or a FIFO planted as a shard is refused too.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Final

from .errors import UnsafePathError

_DRIVE: Final = re.compile(r"^[A-Za-z]:")


def check_relative_name(root: str, name: str, *, what: str) -> None:
    """Reject a file name that is not a plain relative path inside ``root``."""
    where = os.path.join(root, "model.safetensors.index.json")
    if not name:
        raise UnsafePathError(where, f"{what} file name is empty")
    if "\x00" in name:
        raise UnsafePathError(where, f"{what} file name {name!r} contains a NUL byte")
    if "\\" in name:
        raise UnsafePathError(where, f"{what} file name {name!r} contains a backslash")
    if name.startswith("/"):
        raise UnsafePathError(where, f"{what} file name {name!r} is absolute")
    if _DRIVE.match(name):
        raise UnsafePathError(where, f"{what} file name {name!r} has a drive prefix")
    if any(part in ("..", ".", "") for part in name.split("/")):
        raise UnsafePathError(where, f"{what} file name {name!r} is not a normalized relative path")


def open_regular_file(root: str, name: str) -> tuple[int, os.stat_result]:
    """Open ``root/name`` read-only, refusing links that leave ``root`` and non-regular files.

    Returns the descriptor and its ``fstat``. The descriptor is the daemon's handle on
    that inode for its whole life: a later rename over the path does not affect it.
    """
    path = os.path.join(root, name)
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise UnsafePathError(path, f"resolves to {real}, outside the model directory {real_root}")
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO must not hang us
    try:
        fd = os.open(real, flags | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise UnsafePathError(path, "file does not exist") from None
    except OSError as exc:
        raise UnsafePathError(path, f"cannot open: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePathError(path, "is not a regular file")
    os.set_blocking(fd, True)
    return fd, st
