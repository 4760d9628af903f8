"""Where Unix sockets live: a directory only the daemon's user can enter, a lock file
that cannot be aimed at someone else's file, and sockets whose mode is set, not inherited.

Why each check (an attacker on the same host, another uid):

* **The directory.** A socket's own mode is not a reliable guard (it follows the
  umask; some systems ignore it), so access is decided by the directory. One that
  exists already is trusted only if it is a real directory (not a symlink), owned by
  the daemon's uid and closed to other users; anything else is refused with the fix
  in the message. Its owner, or anyone who could write it, could swap the socket
  under the daemon's clients or plant the lock file. It is never "repaired" in place:
  a daemon running as root owns ``/run`` and ``/tmp`` too, and must not ``chmod``
  them. A directory the daemon creates is made 0700 (0750 with group access)
  whatever the umask.
* **The lock file.** It is opened with ``O_NOFOLLOW | O_CREAT`` by descriptor and
  checked (a regular file, ours, one link) before the pid is written into it: a
  planted symlink or hard link cannot make the daemon truncate another file.
* **The socket.** ``chmod`` right after bind (0600, or 0660 with group access), so a
  umask of 000 cannot leave it 0777.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from typing import IO, Final

from ..base.errors import ListenError

#: The socket mode: owner only, or owner and group (``--socket-group-access``).
SOCKET_MODE: Final = 0o600
GROUP_SOCKET_MODE: Final = 0o660
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS: Final = (
    os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
)


def allowed_dir_bits(group: bool) -> int:
    """Permission bits a socket directory may have beyond the owner's (pure).

    Never any for other users, never group write (a group member could replace the
    socket); group read and search only when sockets are shared with the group.
    """
    return 0o050 if group else 0


def dir_problem(st: os.stat_result, uid: int, group: bool) -> str | None:
    """Why ``st`` is not a directory the daemon can trust as found, or None (pure)."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not the daemon's uid {uid}"
    extra = stat.S_IMODE(st.st_mode) & 0o077 & ~allowed_dir_bits(group)
    if extra:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: open to other users"
    return None


def secure_directory(directory: str, *, group: bool = False) -> None:
    """Create ``directory`` 0700 (0750 with ``group``), or verify and repair it.

    Raises :class:`ListenError` naming the directory and what is wrong with it.
    """
    mode = 0o750 if group else 0o700
    parent = os.path.dirname(directory.rstrip("/")) or "/"
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(directory, mode)
        created = True
    except FileExistsError:
        created = False
    except OSError as exc:
        raise ListenError(f"cannot create socket directory {directory}: {exc.strerror}") from None
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        if os.path.islink(directory):
            why = "is a symlink"
        elif exc.errno == errno.ENOTDIR:
            why = "is not a directory"
        else:
            why = f"cannot be opened: {exc.strerror}"
        raise ListenError(f"socket directory {directory} {why}; refusing to use it") from None
    try:
        st = os.fstat(fd)
        if created and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            os.fchmod(fd, mode)  # mkdir applied the umask; be explicit
            st = os.fstat(fd)
        problem = dir_problem(st, os.geteuid(), group)
        if problem is not None:
            raise ListenError(
                f"socket directory {directory} {problem}; refusing to use it (make it "
                f"{mode:04o} and owned by this user, or give --listen a path in a new "
                "directory, which the daemon creates)"
            )
    finally:
        os.close(fd)


def lock_problem(st: os.stat_result, uid: int) -> str | None:
    """Why ``st`` is not a lock file the daemon may write its pid into, or None (pure)."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not the daemon's uid {uid}"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links"
    return None


def take_lock(lock_path: str, socket_path: str) -> IO[str]:
    """Open, check and ``flock`` ``lock_path``; write our pid. Held for the daemon's life."""
    try:
        fd = os.open(lock_path, _LOCK_FLAGS, 0o600)
    except OSError as exc:
        why = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
        raise ListenError(f"lock file {lock_path} {why}; refusing to use it") from None
    lock = os.fdopen(fd, "r+")
    try:
        problem = lock_problem(os.fstat(fd), os.geteuid())
        if problem is not None:
            raise ListenError(f"lock file {lock_path} {problem}; refusing to use it")
        os.set_blocking(fd, True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock.read(64).strip() or "unknown"
            raise ListenError(
                f"another weightd (pid {holder}) is already serving on unix://{socket_path}"
            ) from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
    except BaseException:
        lock.close()
        raise
    return lock


def restrict_socket(path: str, *, group: bool = False) -> None:
    """Set a freshly bound socket's mode (the umask decided it until now)."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise ListenError(f"{path} is not the socket this daemon just bound")
    os.chmod(path, GROUP_SOCKET_MODE if group else SOCKET_MODE)


def remove_stale_socket(path: str) -> None:
    """Unlink a socket left by a daemon that died (the caller holds its lock)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenError(f"{path} exists and is not a socket; refusing to replace it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
