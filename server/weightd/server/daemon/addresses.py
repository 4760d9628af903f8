"""Listening addresses: the one address rule, safe socket homes, and the lock that keeps
one daemon per socket.

Addresses are read by :mod:`weightd.common.addresses`, the rule every client uses too
(a bare path, ``unix://``, ``unix:///``, ``HOST:PORT``), so ``serve --listen ./my.sock``
binds the socket a client given ``./my.sock`` connects to. Defaults are local: a Unix
socket in a 0700 directory (only this user can connect; :mod:`.sockets` creates or
judges it, and moves a socket asked for in a shared directory such as ``/tmp`` into a
private one), or TCP on loopback. A Unix socket path is guarded by an ``flock`` on
``<path>.lock`` because gRPC silently unlinks and takes over an existing socket
(grpc #17122).
"""

from __future__ import annotations

import logging
import os

from weightd.common.addresses import Address, AddressError
from weightd.common.addresses import parse_address as parse_any

from ..base.cleanup import on_error
from ..base.errors import ListenError
from .sockets import (
    SocketLock,
    remove_stale_socket,
    secure_directory,
    socket_home,
    take_lock,
)

__all__ = ["Address", "parse_address", "prepare_unix_socket", "settle_address"]

log = logging.getLogger("weightd")


def parse_address(text: str) -> Address:
    """A listening address by the common rule; one the daemon cannot bind is ListenError."""
    try:
        address = parse_any(text)
    except AddressError as exc:
        raise ListenError(f"listen address: {exc}") from None
    if address.kind == "grpc":
        raise ListenError(
            f"listen address {text!r}: the daemon listens on a Unix socket path or "
            "HOST:PORT, not on a gRPC target scheme"
        )
    return address


def settle_address(address: Address, *, group: bool = False) -> Address:
    """Where ``address`` is really bound: a socket asked for in a shared directory moves
    to a private one beside it (said in the log); TCP stays as given."""
    if address.kind != "unix":
        return address
    path, why = socket_home(address.path, group=group)
    if path == address.path:
        return address
    log.info(
        "socket directory %s: the socket goes in the private directory %s instead (clients "
        "given %s find it there)",
        why,
        os.path.dirname(path),
        address.grpc_target,
    )
    return Address("unix", path=path)


def prepare_unix_socket(path: str, *, group: bool = False) -> SocketLock:
    """Secure the socket's directory, take the socket's lock, clear a stale socket.

    Returns the open lock file, which must stay open for the daemon's lifetime. The
    checks themselves (and why each) are in :mod:`.sockets`.
    """
    secure_directory(os.path.dirname(path), group=group)
    lock = take_lock(path + ".lock", path)
    with on_error(lock.close, f"the lock on {path}"):
        remove_stale_socket(path)  # a daemon that died left it; we hold the lock
    return lock
