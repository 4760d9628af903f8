"""Confining file names from untrusted JSON to a model root, and opening them safely.

``weight_map`` values come from a file anyone could have written; ``Path(root) / name``
happily returns ``/etc/passwd`` for an absolute name. Names are checked as strings
first (pure), then the opened file is checked again by what the kernel says it is,
so a symlink that leaves the root or a FIFO planted as a shard is refused too.

One exception to "links stay inside the root": a Hugging Face cache snapshot is a
directory of links into the repository's ``blobs/`` directory. Only when the caller
names that directory (``link_root``) may a link resolve there, and nowhere else.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Final

from .errors import MissingFileError, NotRegularFileError, PathEscapeError, UnsafePathError

_DRIVE: Final = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True, slots=True)
class OpenedFile:
    """A descriptor on a confined regular file, what ``fstat`` said, and where it resolved."""

    fd: int
    stat: os.stat_result
    real_path: str


def check_relative_name(root: str, name: str, *, what: str, where: str | None = None) -> None:
    """Reject a file name that is not a plain relative path inside ``root``.

    ``where`` is the file the name came from (default: the index), for the message.
    """
    where = where or os.path.join(root, "model.safetensors.index.json")
    if not name:
        raise PathEscapeError(where, f"{what} file name is empty")
    if "\x00" in name:
        raise PathEscapeError(where, f"{what} file name {name!r} contains a NUL byte")
    if "\\" in name:
        raise PathEscapeError(where, f"{what} file name {name!r} contains a backslash")
    if name.startswith("/"):
        raise PathEscapeError(where, f"{what} file name {name!r} is absolute")
    if _DRIVE.match(name):
        raise PathEscapeError(where, f"{what} file name {name!r} has a drive prefix")
    if any(part in ("..", ".", "") for part in name.split("/")):
        raise PathEscapeError(where, f"{what} file name {name!r} is not a normalized relative path")


def _inside(parent: str, child: str) -> bool:
    return os.path.commonpath([parent, child]) == parent


def open_confined(root: str, name: str, *, link_root: str | None = None) -> OpenedFile:
    """Open ``root/name`` read-only if it resolves inside ``root`` (or ``link_root``).

    Refuses non-regular files before opening them (opening a device can have effects)
    and again after (``fstat`` of what was actually opened).
    """
    path = os.path.join(root, name)
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    allowed = _inside(real_root, real)
    if not allowed and link_root is not None:
        allowed = _inside(os.path.realpath(link_root), real)
    if not allowed:
        where = f"the model directory {real_root}"
        if link_root is not None:
            where += f" or the cache's blobs directory {os.path.realpath(link_root)}"
        raise PathEscapeError(path, f"resolves to {real}, outside {where}")
    try:
        before = os.stat(real, follow_symlinks=False)
    except FileNotFoundError:
        raise MissingFileError(path, "file does not exist") from None
    except OSError as exc:
        raise UnsafePathError(path, f"cannot stat: {exc.strerror}") from None
    if not stat.S_ISREG(before.st_mode):
        raise NotRegularFileError(path, f"is not a regular file ({_kind(before.st_mode)})")
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO must not hang us
    try:
        fd = os.open(real, flags | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise MissingFileError(path, "file does not exist") from None
    except OSError as exc:
        raise UnsafePathError(path, f"cannot open: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFileError(path, f"is not a regular file ({_kind(st.st_mode)})")
    os.set_blocking(fd, True)
    return OpenedFile(fd, st, real)


def open_regular_file(root: str, name: str) -> tuple[int, os.stat_result]:
    """Open ``root/name`` read-only, refusing links that leave ``root`` and non-regular files.

    Returns the descriptor and its ``fstat``. The descriptor is the daemon's handle on
    that inode for its whole life: a later rename over the path does not affect it.
    """
    opened = open_confined(root, name)
    return opened.fd, opened.stat


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return word
    return "not a regular file"
