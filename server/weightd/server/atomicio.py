"""Writing a file so that readers see the old version or the whole new one, never a part.

Every file weightd writes (manifests, keys, the hash cache) goes through
:func:`write_atomic`: a temporary file in the target's directory, written completely
(short writes continued), ``fchmod``, ``fsync``, then renamed over the target (or
hard-linked, to create a file that must not exist yet) and the directory fsynced.
Any failure — a full disk (ENOSPC), a quota (EDQUOT), a file-size limit (EFBIG), an
I/O error — removes the temporary file and raises one typed error naming the target,
so the previous file is untouched and the caller can say one precise line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile

from .errors import OutputWriteError, StorageFullError

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
KEPT = "nothing was written there (a previous file, if any, is unchanged)"


def write_error(path: str, exc: OSError) -> OutputWriteError:
    """The typed error for ``exc`` while writing ``path`` (pure)."""
    name = errno.errorcode.get(exc.errno or 0, "")
    what = f"{exc.strerror or exc}" + (f" ({name})" if name else "")
    cls = StorageFullError if exc.errno in _FULL else OutputWriteError
    return cls(path, f"{what}; {KEPT}")


def write_atomic(path: str, data: bytes, *, mode: int = 0o644, exclusive: bool = False) -> None:
    """Put ``data`` at ``path`` atomically (see the module docstring).

    ``exclusive``: refuse (FileExistsError-like OutputWriteError) when ``path`` exists,
    without a window in which a half-written file could be seen (link, not rename).
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    except OSError as exc:
        raise write_error(path, exc) from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, FileExistsError):
            raise OutputWriteError(path, "already exists; refusing to overwrite it") from None
        if isinstance(exc, OSError):
            raise write_error(path, exc) from None
        raise
