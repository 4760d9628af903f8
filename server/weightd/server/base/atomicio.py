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
import re
import tempfile
from collections.abc import Iterator

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
    with atomic_output(path, mode=mode, exclusive=exclusive) as tmp:
        fd = os.open(tmp, os.O_WRONLY)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


#: How a Rust writer (safetensors) reports the OS error under its own exception type.
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _typed(path: str, exc: BaseException) -> OutputWriteError | None:
    """The typed error for a failed write of ``path``; None: not a write failure (pure)."""
    if isinstance(exc, FileExistsError):
        return OutputWriteError(path, "already exists; refusing to overwrite it")
    if isinstance(exc, OSError):
        return write_error(path, exc)
    found = _OS_ERROR.search(str(exc)) if isinstance(exc, Exception) else None
    if found is None:
        return None
    code = int(found.group(1))
    return write_error(path, OSError(code, os.strerror(code)))


@contextlib.contextmanager
def atomic_output(path: str, *, mode: int = 0o644, exclusive: bool = False) -> Iterator[str]:
    """A temporary file name beside ``path``; what is written there is published whole.

    Why a name, not bytes: ``safetensors``' ``save_file`` streams a rank of many GiB
    straight to disk; building the bytes first would hold the rank twice in memory.
    On a clean exit the file gets ``mode``, is fsynced and renamed over ``path`` (with
    ``exclusive``: hard-linked, so an existing file is never replaced) and the
    directory fsynced; on any failure it is removed, and an OS error (or a writer's
    message carrying one, as safetensors' ``SafetensorError`` does) is raised as the
    typed error naming ``path``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
        os.close(fd)
    except OSError as exc:
        raise write_error(path, exc) from None
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
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
        typed = _typed(path, exc)
        if typed is None:
            raise
        raise typed from None
