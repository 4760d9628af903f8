"""Addresses as clients take them, and what to say when the peer there is no daemon.

Every client (``WeightClient``, ``AdminClient``, vLLM's loader, the CLI) reads its
address with :func:`connect_target`, which applies the one rule of
:mod:`weightd.common.addresses` (a bare path, ``unix://``, ``unix:///``,
``HOST:PORT``; none: the daemon's default socket) and, for a socket asked for in a
shared directory such as ``/tmp``, the private directory the daemon moved it to.

gRPC's own words for a failed connection are true but say nothing of the fix:
``failed to connect to all addresses ... No such file or directory``,
``Method not found!``. :func:`peer_error` turns each case into one line that does:
no socket there (:class:`~.errors.DaemonUnreachable`), something that does not speak
gRPC (:class:`~.errors.NotWeightd`), a gRPC server without the method — an older
daemon's admin socket, or another program (:class:`~.errors.MethodNotServed`). A
daemon of this version says the wrong-socket case itself (``AdminOnly``,
``WorkerOnly``, naming the right socket).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from weightd.common.addresses import AddressError, target_or_default
from weightd.common.sockets import default_socket_path, socket_path_for

from ..base.errors import (
    DaemonUnreachable,
    InvalidArgumentError,
    MethodNotServed,
    NotWeightd,
    WeightdError,
    from_rpc_error,
)
from ..transports.selection import SIDE_SOCKET_SUFFIX

if TYPE_CHECKING:  # a same-host fetch never loads gRPC
    import grpc

#: Substrings of gRPC's UNAVAILABLE details that mean no connection was made, as
#: opposed to a daemon that answered UNAVAILABLE itself (a model still verifying).
_NOT_CONNECTED: Final = (
    "failed to connect",
    "connect failed",
    "connection refused",
    "errors resolving",
    "dns resolution failed",
    "name resolution",
)
#: ... and those that mean the peer answered, but not in HTTP/2 (not a gRPC server).
_NOT_GRPC: Final = ("failed parsing http/2", "http1.x server", "expected settings frame")


def connect_target(text: str | None) -> str:
    """The gRPC target for an address as a user gives it (None: the default socket)."""
    try:
        address = target_or_default(text)
    except AddressError as exc:
        raise InvalidArgumentError(str(exc)) from None
    if address.kind != "unix":
        return address.grpc_target
    return f"unix://{socket_path_for(address.path)}"


def unix_path(target: str) -> str | None:
    """The socket path of a ``unix:`` target (None for any other)."""
    if target.startswith("unix://"):
        return target[len("unix://") :]
    if target.startswith("unix:"):
        return os.path.abspath(target[len("unix:") :])
    return None


def not_connected(detail: str) -> bool:
    """Whether gRPC's UNAVAILABLE ``detail`` means no connection was made at all."""
    lowered = detail.lower()
    return any(s in lowered for s in _NOT_CONNECTED)


def missing_socket(target: str) -> DaemonUnreachable | None:
    """The error for a Unix ``target`` whose socket does not exist (None: it does, or TCP)."""
    path = unix_path(target)
    if path is None or os.path.exists(path):
        return None
    if os.path.basename(path) == "admin.sock":  # the admin socket sits beside the worker's
        hint = "pass the admin address its 'listening listener=admin' line names"
    else:
        hint = (
            f"start one with --listen {path}, or pass the address its 'listening' line "
            f"names; the default is unix://{default_socket_path()}"
        )
    return DaemonUnreachable(
        f"no daemon at {target}: {path} does not exist (is `weightd serve` running? {hint})",
        reason="DaemonUnreachable",
    )


def peer_error(target: str, code: grpc.StatusCode | str, detail: str) -> WeightdError | None:
    """One line for a call that reached no weightd daemon at ``target`` (None: it did).

    Only statuses without a daemon's reason come here: a daemon's own UNAVAILABLE (a
    model still verifying) keeps its words. ``code``: the status code or its name.
    """
    name = code if isinstance(code, str) else code.name
    if name == "UNIMPLEMENTED" and "method not found" in detail.lower():
        return MethodNotServed(
            f"the server at {target} does not serve this call ({detail}): a daemon older "
            "than this client, the admin socket of one, or not a weightd daemon. Workers "
            "connect to the worker socket (the 'listening listener=worker' line; default "
            f"unix://{default_socket_path()}); admin calls go to its admin.sock",
            reason="MethodNotServed",
        )
    if name != "UNAVAILABLE":
        return None
    lowered = detail.lower()
    if not_connected(detail) and any(s in lowered for s in _NOT_GRPC):
        path = unix_path(target)
        if path is not None and path.endswith(SIDE_SOCKET_SUFFIX):
            return NotWeightd(
                f"{path} is the daemon's side socket (shared memory), not its gRPC socket: "
                f"give unix://{path.removesuffix(SIDE_SOCKET_SUFFIX)}",
                reason="NotWeightd",
            )
        return NotWeightd(
            f"the peer at {target} is not a weightd daemon (it does not speak gRPC): check "
            "the address; a daemon logs its own in a 'listening' line",
            reason="NotWeightd",
        )
    if not not_connected(detail):
        return None
    missing = missing_socket(target)
    if missing is not None:
        return missing
    if unix_path(target) is None and "resolv" in lowered:
        hint = "the host name does not resolve (a Unix socket is a path: ./x.sock, /run/x.sock)"
    elif unix_path(target) is not None:
        hint = "nothing listens on that socket: is `weightd serve` running? (a daemon that "
        hint += "stopped leaves its socket behind)"
    else:
        hint = "nothing listens there (is `weightd serve --listen HOST:PORT` running?)"
    return DaemonUnreachable(f"no daemon answering at {target}: {hint}", reason="DaemonUnreachable")


@contextlib.contextmanager
def said_plainly(target: str) -> Iterator[None]:
    """Re-raise a failure that reached no weightd daemon at ``target`` as :func:`peer_error`
    says it; every other error passes unchanged."""
    try:
        yield
    except WeightdError as exc:
        if exc.reason:
            raise
        plain = peer_error(target, exc.code_name, exc.detail)
        if plain is None:
            raise
        plain.transport = exc.transport
        raise plain from None


def from_call(error: grpc.RpcError, target: str) -> WeightdError:
    """:func:`~.errors.from_rpc_error`, with a peer that is no daemon said plainly."""
    typed = from_rpc_error(error)
    if typed.reason:
        return typed
    return peer_error(target, typed.code_name, typed.detail) or typed
