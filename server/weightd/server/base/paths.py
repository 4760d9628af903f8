"""Opening files under a directory by descriptor, so a swapped path cannot lead out of it.

``weight_map`` values come from a file anyone could have written, and an adapter
directory is named by a client; ``Path(root) / name`` happily returns ``/etc/passwd``
for an absolute name, and a check of a path string followed by an open of the same
string loses to anyone who swaps a directory for a symlink in between (issue #15
item 2: an adapter outside ``--adapter-root`` was published that way).

So nothing below a root is ever opened by its full path. :class:`ConfinedDir` opens
the root once (the operator's path, resolved once), then walks every name one
component at a time with ``openat`` relative to the descriptor of the directory
before it, each component opened ``O_NOFOLLOW``. A symbolic link met on the way is
read with ``readlinkat`` and resolved by the same walk, its ``..`` popping the walk's
own stack of descriptors (never the kernel's ``..``), so it can only ever land
inside the root; a link that would leave it is refused, naming where it points.
The file at the end is opened relative to its directory's descriptor and checked by
``fstat``: what is verified is what is read, whatever happens to the names meanwhile.

Legitimate links stay usable: a link inside a model directory to a file elsewhere
in it, and a Hugging Face cache snapshot, whose files link to ``../../blobs/<id>``
(the repository directory is the root; a snapshot may reach only itself and
``blobs/``, see :meth:`ConfinedDir.subdir`).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from typing import Final

from .errors import (
    CheckpointError,
    MissingFileError,
    NotRegularFileError,
    PathEscapeError,
    UnsafePathError,
)

_DRIVE: Final = re.compile(r"^[A-Za-z]:")
#: Links followed while resolving one name (the kernel's own limit is 40 too).
MAX_LINKS: Final = 40
#: Walking descriptors: O_PATH needs no read permission and opens nothing's content.
_DIR_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: a FIFO planted where a file is expected must not hang the open.
_FILE_FLAGS: Final = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW


@dataclass(frozen=True, slots=True)
class OpenedFile:
    """A descriptor on a confined regular file, what ``fstat`` said, and where it resolved."""

    fd: int
    stat: os.stat_result
    real_path: str
    linked: bool = False  # a symbolic link was followed to reach it


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


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class _Walk:
    """A walk's stack of directory descriptors: the first ones borrowed, the rest its own.

    ``fds[i]`` is the directory of ``parts[:i]`` (``fds[0]`` the root), so a link's
    ``..`` pops back to the parent's descriptor without the kernel's ``..``.
    """

    def __init__(self, fds: list[int], parts: tuple[str, ...]) -> None:
        self.fds = list(fds)
        self.parts = list(parts)
        self.borrowed = len(fds)  # fds[:borrowed] belong to the ConfinedDir
        self.linked = False
        self.links = 0
        self.target = ""  # the last link's target, for messages

    def push(self, fd: int, comp: str) -> None:
        self.fds.append(fd)
        self.parts.append(comp)

    def pop(self) -> None:
        fd = self.fds.pop()
        self.parts.pop()
        if len(self.fds) >= self.borrowed:
            os.close(fd)
        else:
            self.borrowed = len(self.fds)

    def to_root(self) -> None:
        while self.parts:
            self.pop()

    def close(self) -> None:
        """Close the walk's own descriptors (the borrowed ones stay open)."""
        _close_all(self.fds[self.borrowed :])
        del self.fds[self.borrowed :]

    def take(self) -> list[int]:
        """Every descriptor as the caller's own (borrowed ones duplicated)."""
        fds = [os.dup(fd) for fd in self.fds[: self.borrowed]] + self.fds[self.borrowed :]
        self.fds, self.borrowed = [], 0
        return fds


class ConfinedDir:
    """An open directory under a root; every name below it is resolved by descriptor.

    Made by :meth:`open` (a root) or :meth:`subdir`. Owns one descriptor per directory
    from the root down to itself (so a link's ``..`` can go back up by descriptor);
    close it, or use it as a context manager.
    """

    def __init__(
        self,
        fds: list[int],
        parts: tuple[str, ...],
        root_real: str,
        label: str,
        reach: tuple[tuple[str, ...], ...],
        escape: type[PathEscapeError],
    ) -> None:
        self._fds = fds  # root first; this directory's own descriptor last
        self.parts = parts  # components from the root down to this directory
        self.root_real = root_real
        self.label = label  # how messages name it: "the model directory /m"
        self._reach = reach  # where files opened here may resolve (component prefixes)
        self._escape = escape
        self._root_label = label

    # --- making one -------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str,
        *,
        label: str = "the model directory",
        escape: type[PathEscapeError] = PathEscapeError,
    ) -> ConfinedDir:
        """Open the root ``path`` (the operator's path: links in it are followed, once).

        Resolved once and opened ``O_DIRECTORY | O_NOFOLLOW``; from then on only the
        descriptor counts, wherever the path string later points.
        """
        if "\x00" in path:
            raise escape(repr(path), "contains a NUL byte")
        real = os.path.realpath(path)
        try:
            fd = os.open(real, _DIR_FLAGS)
        except FileNotFoundError:
            raise MissingFileError(path, "is not a directory (it does not exist)") from None
        except NotADirectoryError:
            raise CheckpointError(path, "is not a directory") from None
        except OSError as exc:
            # ELOOP: ``real`` became a link after it was resolved; refuse, never follow.
            raise UnsafePathError(path, f"cannot open the directory: {exc.strerror}") from None
        return cls([fd], (), real, f"{label} {real}", ((),), escape)

    def subdir(
        self,
        name: str,
        *,
        label: str,
        also: tuple[str, ...] = (),
        escape: type[PathEscapeError] | None = None,
    ) -> ConfinedDir:
        """The directory ``name`` below this one, resolved inside the root.

        Files opened in the result may resolve only inside it, or inside the
        directories ``also`` names (relative to the root: a snapshot's ``blobs``).
        """
        where = f"{self.path}/{name}"
        walk = self._resolve(self._components(name, where), where)
        parts = tuple(walk.parts)
        if parts[: len(self.parts)] != self.parts or parts == self.parts:
            walk.close()
            shown = os.path.join(self.root_real, *parts)
            raise self._escape(where, f"resolves to {shown}, not a directory inside {self.label}")
        reach = (parts, *(tuple(p.split("/")) for p in also))
        real = os.path.join(self.root_real, *parts)
        out = ConfinedDir(
            walk.take(), parts, self.root_real, f"{label} {real}", reach, escape or self._escape
        )
        out._root_label = self._root_label
        return out

    # --- using one --------------------------------------------------------------------

    @property
    def path(self) -> str:
        """This directory's real path (for messages and keys; never opened by it)."""
        return os.path.join(self.root_real, *self.parts)

    @property
    def fd(self) -> int:
        return self._fds[-1]

    def exists(self, name: str) -> bool:
        """Whether ``name`` (one component) is an entry here, as ``lexists`` says."""
        if "/" in name:
            raise ValueError(f"exists() takes one component, not {name!r}")
        self._components(name, os.path.join(self.path, name))
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return False
        return True

    def open_file(self, name: str) -> OpenedFile:
        """Open the regular file ``name`` (relative, ``/``-separated) read-only.

        Refuses non-regular files before opening them (opening a device can have
        effects) and again after (``fstat`` of what was actually opened).
        """
        where = f"{self.path}/{name}"
        walk = _Walk(self._fds, self.parts)
        try:
            last = self._advance(walk, self._components(name, where), where, want_dir=False)
            return self._open_last(walk, last, where)
        finally:
            walk.close()

    def close(self) -> None:
        fds, self._fds = self._fds, []
        _close_all(fds)

    def __enter__(self) -> ConfinedDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the walk ---------------------------------------------------------------------

    def _components(self, name: str, where: str) -> list[str]:
        if not name:
            raise self._escape(where, "the name is empty")
        if "\x00" in name:
            raise self._escape(repr(where), "contains a NUL byte")
        if name.startswith("/"):
            raise self._escape(where, f"{name!r} is absolute, not a name inside {self.label}")
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise self._escape(where, f"{name!r} has a '..' component")
        if not parts:
            raise self._escape(where, "names no entry")
        return parts

    def _resolve(self, pending: list[str], where: str) -> _Walk:
        """Walk the directories ``pending`` from here, by descriptor (the caller closes it)."""
        walk = _Walk(self._fds, self.parts)
        try:
            self._advance(walk, pending, where, want_dir=True)
        except BaseException:
            walk.close()
            raise
        return walk

    def _advance(
        self, walk: _Walk, pending: list[str], where: str, *, want_dir: bool
    ) -> str | None:
        """Walk ``pending`` on ``walk``, following links inside the root.

        With ``want_dir`` false the last component is not opened but returned (None
        when the name ends at a directory: ``..`` or a link to the root).
        """
        pending = list(pending)
        while pending:
            comp = pending.pop(0)
            if comp in ("", "."):
                continue
            if comp == "..":
                if not walk.parts:
                    raise self._escape(
                        where, f"links to {walk.target}, which leads outside {self._root_label}"
                    )
                walk.pop()
                continue
            if not pending and not want_dir:
                return comp
            try:
                fd = os.open(comp, _DIR_FLAGS, dir_fd=walk.fds[-1])
            except OSError as exc:
                shown = os.path.join(self.root_real, *walk.parts, comp)
                target = _link_target(walk.fds[-1], comp, exc, shown, where)
                pending[:0] = self._follow(walk, target, where)
                continue
            walk.push(fd, comp)
        return None

    def _follow(self, walk: _Walk, target: str, where: str) -> list[str]:
        """Count a link and return its target's components (an absolute one from the root)."""
        self._count(walk, where)
        walk.target = target
        if not target:
            raise self._escape(where, "a link with an empty target")
        if not target.startswith("/"):
            return target.split("/")
        norm = os.path.normpath(target)
        if os.path.commonpath([self.root_real, norm]) != self.root_real:
            raise self._escape(where, f"links to {target}, outside {self._root_label}")
        walk.to_root()
        rel = os.path.relpath(norm, self.root_real)
        return [] if rel == "." else rel.split("/")

    @staticmethod
    def _count(walk: _Walk, where: str) -> None:
        walk.links += 1
        walk.linked = True
        if walk.links > MAX_LINKS:
            raise UnsafePathError(where, f"more than {MAX_LINKS} symbolic links")

    def _open_last(self, walk: _Walk, comp: str | None, where: str) -> OpenedFile:
        """Open ``comp`` in the walk's top directory as a regular file, following links."""
        while True:
            if comp is None:
                raise NotRegularFileError(where, "is not a regular file (a directory)")
            dir_fd = walk.fds[-1]
            try:
                before = os.stat(comp, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise MissingFileError(where, "file does not exist") from None
            except OSError as exc:
                raise UnsafePathError(where, f"cannot stat: {exc.strerror}") from None
            if stat.S_ISLNK(before.st_mode):
                try:
                    target = os.readlink(comp, dir_fd=dir_fd)
                except OSError:  # replaced meanwhile: look again (bounded by MAX_LINKS)
                    self._count(walk, where)
                    continue
                more = self._follow(walk, target, where)
                comp = self._advance(walk, more, where, want_dir=False)
                continue
            parts = (*walk.parts, comp)
            self._check_reach(parts, where)
            if not stat.S_ISREG(before.st_mode):
                raise NotRegularFileError(where, f"is not a regular file ({_kind(before.st_mode)})")
            try:
                fd = os.open(comp, _FILE_FLAGS, dir_fd=dir_fd)
            except FileNotFoundError:
                raise MissingFileError(where, "file does not exist") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # became a link after the stat: look again
                    self._count(walk, where)
                    continue
                raise UnsafePathError(where, f"cannot open: {exc.strerror}") from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise NotRegularFileError(where, f"is not a regular file ({_kind(st.st_mode)})")
            os.set_blocking(fd, True)
            return OpenedFile(fd, st, os.path.join(self.root_real, *parts), walk.linked)

    def _check_reach(self, parts: tuple[str, ...], where: str) -> None:
        if any(parts[: len(p)] == p for p in self._reach):
            return
        real = os.path.join(self.root_real, *parts)
        extra = [os.path.join(self.root_real, *p) for p in self._reach if p != self.parts]
        allowed = self.label + "".join(f" or {e}" for e in extra)
        raise self._escape(where, f"resolves to {real}, outside {allowed}")


def _link_target(dir_fd: int, comp: str, exc: OSError, shown: str, where: str) -> str:
    """What the entry ``comp`` (``shown``) links to; the right error when it is no link."""
    missing = "does not exist" if shown == where else f"does not exist ({shown} is missing)"
    if exc.errno == errno.ENOENT:
        raise MissingFileError(where, missing) from None
    if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
        raise UnsafePathError(shown, f"cannot open: {exc.strerror}") from None
    try:
        return os.readlink(comp, dir_fd=dir_fd)
    except FileNotFoundError:
        raise MissingFileError(where, missing) from None
    except OSError as exc2:
        if exc2.errno == errno.EINVAL:  # no link: a file where a directory belongs
            raise UnsafePathError(shown, "is not a directory") from None
        raise UnsafePathError(shown, f"cannot read the link: {exc2.strerror}") from None


def open_confined(root: str, name: str) -> OpenedFile:
    """Open ``root/name`` read-only through a :class:`ConfinedDir` on ``root`` (one file)."""
    with ConfinedDir.open(root) as directory:
        return directory.open_file(name)


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
