"""Where the daemon listens by default, known to both sides.

The daemon binds this path when started without ``--listen``; clients that take no
target (vLLM's loader, whose extra config may omit ``target``) connect to the same
path, so "one flag away" holds without either side repeating the rule.
"""

from __future__ import annotations

import os
import stat


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/weightd/weightd.sock``, else ``/run/weightd`` for root, else /tmp."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        base = os.path.join(runtime, "weightd")
    elif os.geteuid() == 0:
        base = "/run/weightd"
    else:
        base = f"/tmp/weightd-{os.geteuid()}"
    return os.path.join(base, "weightd.sock")


#: The admin listener's socket, beside the worker socket unless told otherwise.
ADMIN_SOCKET_NAME = "admin.sock"


def default_admin_path() -> str:
    """The admin socket of a daemon on its default socket (``admin.sock`` beside it)."""
    return os.path.join(os.path.dirname(default_socket_path()), ADMIN_SOCKET_NAME)


def default_target() -> str:
    """The default socket as a gRPC target string."""
    return f"unix://{default_socket_path()}"


def shared_directory(mode: int) -> bool:
    """Whether a directory of ``mode`` is shared like ``/tmp``: other users may create
    entries in it, and only the sticky bit keeps them from renaming or removing ours."""
    return bool(mode & stat.S_ISVTX) and bool(mode & 0o022)


def private_socket_path(path: str, uid: int) -> str:
    """Where a socket asked for in a shared directory lives: in ``weightd-UID`` beside it.

    ``/tmp/weightd.sock`` → ``/tmp/weightd-1000/weightd.sock``. The daemon creates that
    directory 0700 (it never changes a shared directory's mode) and binds there; a
    client given the first path connects to the second (same uid), so the address a
    user typed works on both sides.
    """
    directory, name = os.path.split(path)
    return os.path.join(directory, f"weightd-{uid}", name)


def socket_path_for(path: str, uid: int | None = None) -> str:
    """The socket a client given ``path`` connects to: ``path`` itself, unless it does not
    exist and its directory is shared (then :func:`private_socket_path`)."""
    if os.path.exists(path):
        return path
    try:
        mode = os.stat(os.path.dirname(path) or ".").st_mode
    except OSError:
        return path
    if not shared_directory(mode):
        return path
    return private_socket_path(path, os.geteuid() if uid is None else uid)
