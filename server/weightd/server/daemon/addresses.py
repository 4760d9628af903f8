"""Listening addresses: parsing, safe defaults, and the lock that keeps one daemon per socket.

Defaults are local: a Unix socket in a 0700 directory (only this user can connect;
:mod:`.sockets` creates or verifies it), or TCP on loopback. A Unix socket path is
guarded by an ``flock`` on ``<path>.lock`` because gRPC silently unlinks and takes over
an existing socket (grpc #17122).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import IO

from ..base.cleanup import on_error
from ..base.errors import ListenError
from .sockets import remove_stale_socket, secure_directory, take_lock


@dataclass(frozen=True, slots=True)
class Address:
    kind: str  # "unix" or "tcp"
    path: str = ""  # unix
    host: str = ""  # tcp
    port: int = 0

    @property
    def grpc_target(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.kind == "unix":
            return True
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_address(text: str) -> Address:
    if text.startswith("unix://"):
        path = text[len("unix://") :]
        if not path.startswith("/"):
            raise ListenError(f"listen address {text!r}: unix:// needs an absolute path")
        return Address("unix", path=path)
    if text.startswith("unix:"):
        return Address("unix", path=os.path.abspath(text[len("unix:") :]))
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ListenError(f"listen address {text!r} is neither unix:///PATH nor HOST:PORT")
    host = host.strip("[]")
    port = int(port_text)
    if port > 65535:
        raise ListenError(f"listen address {text!r}: port {port} is out of range")
    return Address("tcp", host=host or "127.0.0.1", port=port)


def prepare_unix_socket(path: str, *, group: bool = False) -> IO[str]:
    """Secure the socket's directory, take the socket's lock, clear a stale socket.

    Returns the open lock file, which must stay open for the daemon's lifetime. The
    checks themselves (and why each) are in :mod:`.sockets`.
    """
    secure_directory(os.path.dirname(path), group=group)
    lock = take_lock(path + ".lock", path)
    with on_error(lock.close, f"the lock on {path}"):
        remove_stale_socket(path)  # a daemon that died left it; we hold the lock
    return lock
