"""Where Unix sockets live: a directory only the daemon's user can enter, a lock file
that cannot be aimed at someone else's file, and sockets whose mode is set, not inherited.

Why each check (an attacker on the same host, another uid):

* **The directory.** Anyone who can write the socket's directory could swap the
  socket under the daemon's clients or plant the lock file, so a directory that
  exists is used as it is only when it is a real directory (not a symlink), owned by
  the daemon's uid and writable by no one else (:func:`dir_plan`). Others may still
  read or search it (``mkdir``'s 0755): on Linux connecting needs write permission
  on the socket itself, which is 0600 right after bind, and such a directory is used
  only under a umask that already denies others write, so no one connects in
  between. A directory shared like ``/tmp`` (sticky, writable by all) gets a private
  ``weightd-UID`` directory inside, which the daemon creates and clients given the
  first path find too (:mod:`weightd.common.sockets`). Anything else is refused with
  a path that works. A directory is never "repaired" in place: a daemon running as
  root owns ``/run`` and ``/tmp`` too, and must not ``chmod`` them, and no message
  suggests it. A directory the daemon creates is made 0700 (0750 with group access)
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

from weightd.common.sockets import default_socket_path, private_socket_path, shared_directory

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


#: What to do with the directory a socket was asked for in (see :func:`dir_plan`).
USE: Final = "use"
PRIVATE: Final = "private"
REFUSE: Final = "refuse"


def dir_plan(st: os.stat_result, uid: int, group: bool, umask: int | None) -> tuple[str, str]:
    """Whether a socket can go in the existing directory ``st`` as it is (pure).

    (:data:`USE`, ""): the daemon's own, writable by no one else; readable or searchable
    by others only where the socket's mode alone keeps them out (``mkdir``'s 0755:
    the socket is chmod 0600 right after bind, and bound under a ``umask`` that already
    denies others write, so no one can connect in between). (:data:`PRIVATE`, why):
    shared like ``/tmp`` (sticky, writable by others): the socket goes in a private
    ``weightd-UID`` directory inside (:func:`~weightd.common.sockets.private_socket_path`).
    (:data:`REFUSE`, why): anything else; why says what is wrong, never "chmod it".
    """
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode):
        return REFUSE, "is not a directory"
    if shared_directory(st.st_mode):
        return PRIVATE, f"is shared with other users (mode {mode:04o})"
    if st.st_uid != uid:
        return REFUSE, f"is owned by uid {st.st_uid}, not the daemon's uid {uid}"
    if mode & 0o022:
        return REFUSE, f"has mode {mode:04o}: other users could replace the socket"
    if not mode & 0o077 & ~allowed_dir_bits(group):
        return USE, ""
    closed = 0o002 | (0 if group else 0o020)
    if umask is not None and umask & closed == closed:
        return USE, ""
    return PRIVATE, f"has mode {mode:04o} and the umask lets other users connect"


def current_umask() -> int | None:
    """This process's umask, read without changing it (``/proc``; None if unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        return None
    return None


def socket_home(path: str, *, group: bool = False) -> tuple[str, str]:
    """Where the socket asked for at ``path`` is bound, and why it moved ("" if not).

    A directory that does not exist yet is created by :func:`secure_directory`; one
    that exists is judged by :func:`dir_plan`. Raises :class:`ListenError` for a
    directory no socket may go in, naming a path that works.
    """
    directory = os.path.dirname(path) or "."
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return path, ""
    except OSError as exc:
        raise ListenError(f"socket directory {directory} cannot be read: {exc.strerror}") from None
    plan, why = dir_plan(st, os.geteuid(), group, current_umask())
    if plan == USE:
        return path, ""
    if plan == PRIVATE:
        return private_socket_path(path, os.geteuid()), f"{directory} {why}"
    raise ListenError(
        f"socket directory {directory} {why}; refusing to put a socket in it. Give --listen "
        f"a path in a directory only this user can write, or one that does not exist yet "
        f"(the daemon creates it 0700), e.g. unix://{default_socket_path()}"
    )


def secure_directory(directory: str, *, group: bool = False) -> None:
    """Create ``directory`` 0700 (0750 with ``group``), or verify it (:func:`dir_plan`).

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
        if created:
            problem = dir_problem(st, os.geteuid(), group)
        else:
            plan, why = dir_plan(st, os.geteuid(), group, current_umask())
            problem = None if plan == USE else why
        if problem is not None:
            raise ListenError(
                f"socket directory {directory} {problem}; refusing to use it (give --listen "
                "a path in a directory that does not exist yet, which the daemon creates "
                f"{mode:04o}, e.g. unix://{default_socket_path()})"
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


class SocketLock:
    """The daemon's ``flock`` on ``<socket>.lock``, held for its life.

    :meth:`close` removes the file (a clean exit leaves no lock behind), but only while
    it still holds the lock and only the inode it locked; a daemon that locks a file
    checks that it is still the one at the path, so two daemons can never each hold a
    lock on a different inode of the same name.
    """

    def __init__(self, path: str, file: IO[str]) -> None:
        self.path = path
        self._file = file

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            if _same_file(self.path, self._file.fileno()):
                os.unlink(self.path)
        except OSError:
            pass  # removing it is a courtesy: the next daemon takes a lock left behind
        finally:
            self._file.close()


def _same_file(path: str, fd: int) -> bool:
    try:
        at_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (at_path.st_dev, at_path.st_ino) == (held.st_dev, held.st_ino)


#: Times a lock is taken again after its file was removed (by the daemon that held it,
#: exiting) between our open and our flock.
_LOCK_TRIES: Final = 5


def lock_holder(lock_path: str) -> str | None:
    """The pid held in ``lock_path`` while another process holds its lock, else None.

    A dry run of :func:`take_lock` for ``weightd serve``'s checks before its first log
    line; the daemon still takes the lock itself (the answer may be stale by then).
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # missing, or a problem take_lock names in its own words
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 64).decode("ascii", "replace").strip() or "unknown"
        return None
    finally:
        os.close(fd)


def already_serving(holder: str, socket_path: str) -> ListenError:
    shown = holder if holder.isdigit() else repr(holder[:20])
    return ListenError(f"another weightd (pid {shown}) is already serving on unix://{socket_path}")


def take_lock(lock_path: str, socket_path: str) -> SocketLock:
    """Open, check and ``flock`` ``lock_path``; write our pid. Held for the daemon's life."""
    for _ in range(_LOCK_TRIES):
        lock = _lock_once(lock_path, socket_path)
        if lock is not None:
            return lock
    raise ListenError(f"lock file {lock_path} keeps being replaced; refusing to use it")


def _lock_once(lock_path: str, socket_path: str) -> SocketLock | None:
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
            raise already_serving(lock.read(64).strip() or "unknown", socket_path) from None
        if not _same_file(lock_path, fd):  # its holder removed it as it exited: again
            lock.close()
            return None
        lock.seek(0)
        lock.truncate()
        lock.write(f"{os.getpid()}\n")
        lock.flush()
    except BaseException:
        lock.close()
        raise
    return SocketLock(lock_path, lock)


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
