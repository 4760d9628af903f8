"""Reading a small file someone named, safely: one open, checks by descriptor, a bound.

Manifests, keys, config files and journals are named by operators or left on disk by
an earlier run; any of them may be a FIFO (a read that never returns), a directory,
``/dev/zero`` (a read that never ends) or a file swapped between a check and an open.
:func:`read_bounded` opens once (non-blocking, so a FIFO cannot stall the open),
checks the descriptor it holds is a regular file, and reads at most ``limit + 1``
bytes. Each caller turns :class:`ReadRefused` into its own typed error.
"""

from __future__ import annotations

import os
import stat


class ReadRefused(Exception):
    """Why the file was not read: ``reason`` reads after the path (``is not a regular
    file``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_bounded(path: str, limit: int, *, follow: bool = True, private: bool = False) -> bytes:
    """At most ``limit`` bytes of the regular file at ``path``; more is refused.

    ``follow=False`` refuses a symbolic link as the last component. ``private``: a file
    the daemon left for itself (a cache it will trust), so it must be what only the
    daemon's user could have written: the file and its directory owned by this user
    and writable by no one else, the file with one link (implies ``follow=False``).
    """
    if private:
        follow = False
        _check_private_dir(os.path.dirname(path) or ".")
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ReadRefused(f"cannot read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReadRefused("is not a regular file")
        if private:
            _check_private(st, "the file")
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ReadRefused(f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ReadRefused(f"is larger than the {limit}-byte limit")
    return b"".join(chunks)


def _check_private(st: os.stat_result, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise ReadRefused(f"is not trusted: {what} is owned by uid {st.st_uid}, not this user")
    if st.st_mode & 0o022:
        raise ReadRefused(
            f"is not trusted: other users can write {what} ({stat.filemode(st.st_mode)})"
        )
    if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
        raise ReadRefused(f"is not trusted: {what} has {st.st_nlink} links")


def _check_private_dir(directory: str) -> None:
    try:
        st = os.lstat(directory)
    except OSError as exc:
        raise ReadRefused(f"cannot read: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ReadRefused("is not trusted: its directory is not a directory (a link?)")
    _check_private(st, "its directory")
