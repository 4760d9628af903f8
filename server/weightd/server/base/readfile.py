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


def read_bounded(path: str, limit: int, *, follow: bool = True) -> bytes:
    """At most ``limit`` bytes of the regular file at ``path``; more is refused.

    ``follow=False`` refuses a symbolic link as the last component.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ReadRefused(f"cannot read: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ReadRefused("is not a regular file")
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
