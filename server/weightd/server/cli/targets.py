"""Daemon addresses as people type them, and what to say when nothing answers there.

gRPC reads a bare ``/run/weightd/weightd.sock`` as a host name and answers with a DNS
error, and a socket that does not exist with ``connect failed ... No such file or
directory``: both true, neither says what to do. The client commands pass what the
user typed through :func:`daemon_target` (a path is the Unix socket it plainly names)
and turn "nothing listens there" into one line that says so (:func:`unreachable`).
Pure apart from :func:`missing_socket`'s ``stat``; no gRPC here.
"""

from __future__ import annotations

import os
from typing import Final

from ..base.errors import DaemonUnreachable

#: gRPC's own target schemes: a target naming one is passed through untouched.
_SCHEMES: Final = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")

#: Substrings of gRPC's UNAVAILABLE details that mean "no connection was made", as
#: opposed to a daemon that answered UNAVAILABLE itself (a model still verifying).
_NOT_CONNECTED: Final = (
    "failed to connect",
    "connect failed",
    "connection refused",
    "errors resolving",
    "dns resolution failed",
    "name resolution",
)


def daemon_target(text: str) -> str:
    """The gRPC target for ``text``: ``/x.sock``, ``./x.sock``, ``x.sock`` → ``unix://`` + path."""
    if text.startswith(_SCHEMES) or "://" in text:
        return text
    if text.startswith(("/", "./", "../", "~")) or text.endswith(".sock"):
        return "unix://" + os.path.abspath(os.path.expanduser(text))
    return text


def unix_path(target: str) -> str | None:
    """The socket path of a ``unix:`` target (None for any other)."""
    if target.startswith("unix://"):
        return target[len("unix://") :]
    if target.startswith("unix:"):
        return os.path.abspath(target[len("unix:") :])
    return None


def missing_socket(target: str) -> DaemonUnreachable | None:
    """The error to report when ``target`` is a Unix socket that does not exist."""
    path = unix_path(target)
    if path is None or os.path.exists(path):
        return None
    return DaemonUnreachable(
        f"no daemon at {target}: {path} does not exist (is `weightd serve` running? it logs "
        "its address in a 'listening' line)"
    )


def not_connected(detail: str) -> bool:
    """Whether gRPC's UNAVAILABLE ``detail`` means no connection was made at all."""
    lowered = detail.lower()
    return any(s in lowered for s in _NOT_CONNECTED)


def unreachable(target: str, detail: str) -> DaemonUnreachable:
    """Nothing answered at ``target``: say so, what to check, and gRPC's own words."""
    hint = "is `weightd serve` running there?"
    if unix_path(target) is None and "resolv" in detail.lower():
        hint = "the name does not resolve (a Unix socket is written unix:///PATH)"
    return DaemonUnreachable(f"no daemon answering at {target}: {hint} (gRPC: {detail})")
