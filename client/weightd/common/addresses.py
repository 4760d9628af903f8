"""The one address rule, for the daemon's listeners and every client. Pure.

Everything that takes a daemon address (``weightd serve --listen``, every CLI command,
``WeightClient``, ``AdminClient``, vLLM's ``target``) reads it here, so one string
means the same socket everywhere:

=====================================  ===============================================
``/run/weightd/weightd.sock``          a Unix socket (absolute path)
``./my.sock``, ``run/w.sock``,         a Unix socket relative to the working directory
``my.sock``, ``~/w.sock``              (a bare name must end in ``.sock``)
``unix:///run/x.sock``                 a Unix socket (gRPC's absolute form)
``unix://my.sock``, ``unix:my.sock``   a Unix socket relative to the working directory
``host:7070``, ``[::1]:7070``,         TCP (``:7070`` is loopback); TLS as configured
``:7070``
``dns:///host:7070``, ``ipv4:...``,    other gRPC target schemes: clients pass them
``ipv6:...``, ``unix-abstract:...``    through as they are; the daemon listens on none
=====================================  ===============================================

Anything else (``localhost`` without a port, ``http://...``) is one
:class:`AddressError` that lists these forms. No address at all means the daemon's
default socket (:mod:`.sockets`).

Why here: the client and the daemon both import ``weightd.common``, so neither can
drift from the other (``serve --listen ./my.sock`` binds the socket a client given
``./my.sock`` connects to).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Final, Literal

from .sockets import default_socket_path

#: gRPC target schemes other than ``unix:`` a client passes through untouched.
PASS_THROUGH: Final = ("dns:", "ipv4:", "ipv6:", "unix-abstract:", "vsock:")
FORMS: Final = (
    "a socket path (/run/x.sock, ./x.sock, x.sock), unix:///PATH, unix:PATH, HOST:PORT, "
    "or a gRPC target (dns:///HOST:PORT)"
)


class AddressError(ValueError):
    """An address that fits none of the forms; the message lists them."""


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed address: a Unix socket (``path``), TCP (``host``, ``port``) or another
    gRPC target passed through (``target``)."""

    kind: Literal["unix", "tcp", "grpc"]
    path: str = ""  # unix: absolute
    host: str = ""  # tcp
    port: int = 0
    target: str = ""  # grpc: as given

    @property
    def grpc_target(self) -> str:
        """The address as gRPC reads it: ``unix:///abs/path``, ``host:port``, or as given."""
        if self.kind == "unix":
            return f"unix://{self.path}"
        if self.kind == "grpc":
            return self.target
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.kind != "tcp":
            return self.kind == "unix"
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return self.grpc_target


def parse_address(text: str, *, cwd: str | None = None) -> Address:
    """``text`` by the rule above; relative paths against ``cwd`` (default: the process's)."""
    given = text.strip()
    if not given:
        raise AddressError(f"an empty address; give {FORMS}")
    if given.startswith("unix:"):
        rest = given[len("unix:") :]
        if rest.startswith("//"):
            rest = rest[2:]  # unix:///abs -> /abs; unix://rel -> rel
        if not rest:
            raise AddressError(f"address {given!r} names no socket path; give {FORMS}")
        return Address("unix", path=_absolute(rest, cwd))
    if given.startswith(PASS_THROUGH):
        return Address("grpc", target=given)
    if "://" in given:
        scheme = given.split("://", 1)[0]
        raise AddressError(
            f"address {given!r}: scheme {scheme!r} is not one weightd uses; give {FORMS}"
        )
    if given.startswith(("/", "./", "../", "~")) or "/" in given:
        return Address("unix", path=_absolute(given, cwd))
    host, sep, port_text = given.rpartition(":")
    if sep:
        if not port_text.isdigit() or int(port_text) > 65535:
            raise AddressError(
                f"address {given!r}: port {port_text!r} is not 0-65535; give {FORMS}"
            )
        return Address("tcp", host=host.strip("[]") or "127.0.0.1", port=int(port_text))
    if given.endswith(".sock"):
        return Address("unix", path=_absolute(given, cwd))
    raise AddressError(
        f"address {given!r} is neither a socket path nor HOST:PORT (a bare file name "
        f"must end in .sock: ./{given} names a socket in this directory); give {FORMS}"
    )


def target_or_default(text: str | None) -> Address:
    """``text`` by the rule, or the daemon's default socket when there is none."""
    if text is None or not text.strip():
        return Address("unix", path=default_socket_path())
    return parse_address(text)


def _absolute(path: str, cwd: str | None) -> str:
    expanded = os.path.expanduser(path)
    if cwd is not None and not os.path.isabs(expanded):
        expanded = os.path.join(cwd, expanded)
    return os.path.abspath(expanded)
