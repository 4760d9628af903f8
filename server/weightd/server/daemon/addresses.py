"""Listening addresses: parsing, safe defaults, and the lock that keeps one daemon per socket.

Defaults are local: a Unix socket in a 0700 directory (only this user can connect),
or TCP on loopback. A Unix socket path is guarded by an ``flock`` on ``<path>.lock``
because gRPC silently unlinks and takes over an existing socket (grpc #17122).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import stat
from dataclasses import dataclass
from typing import IO

from ..base.errors import ListenError


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


def prepare_unix_socket(path: str) -> IO[str]:
    """Make the socket's directory (0700 when we create it) and take the socket's lock.

    Returns the open lock file, which must stay open for the daemon's lifetime.
    """
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # makedirs applies the umask; be explicit
    lock_path = path + ".lock"
    lock = open(lock_path, "a+")  # noqa: SIM115 - held open for the daemon's lifetime
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise ListenError(
            f"another weightd (pid {holder}) is already serving on unix://{path}"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return lock
    if not stat.S_ISSOCK(st.st_mode):
        lock.close()
        raise ListenError(f"{path} exists and is not a socket; refusing to replace it")
    os.unlink(path)  # a stale socket from a daemon that died; we hold the lock
    return lock
