"""Wiring the daemon's listeners: worker, admin, health-only and metrics.

Kept apart from :mod:`.assembly` so the factory reads as a list of decisions, and the
decisions' details (default admin socket, port binding errors, reflection) live here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent import futures
from importlib import metadata
from typing import Final

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from weightd.common.sockets import ADMIN_SOCKET_NAME, default_socket_path

from ..base.errors import ListenError, SecurityConfigError
from ..registry.loading import Reloader
from ..registry.models import ModelRegistry
from ..rpc.adapters import Adapters
from ..rpc.admin import create_admin_server
from ..rpc.health import ListenerHealth
from ..rpc.interceptors import RpcObserver
from ..rpc.peers import (
    SMALL_LISTENER_CONNECTIONS,
    SMALL_LISTENER_IDLE_SECONDS,
    connection_options,
)
from ..rpc.requests import RequestGuard
from ..rpc.streams import StreamBounds, StreamWatchdog
from ..rpc.versions import Versions
from .addresses import Address, parse_address
from .security import TlsMaterial
from .sockets import restrict_socket


def version() -> str:
    try:
        return metadata.version("weightd")
    except metadata.PackageNotFoundError:
        return "unknown"


def admin_address(text: str | None, worker: Address) -> Address | None:
    """Where the admin listener goes (pure): ``none`` → nowhere; None → ``admin.sock`` in
    the worker socket's 0700 directory (or the default directory when workers use TCP)."""
    if text is not None and text.lower() == "none":
        return None
    if text is None:
        base = worker.path if worker.kind == "unix" else default_socket_path()
        return Address("unix", path=os.path.join(os.path.dirname(base), ADMIN_SOCKET_NAME))
    address = parse_address(text)
    same_socket = address.kind == "unix" and address.path == worker.path
    same_port = address.kind == "tcp" and address.port != 0 and address == worker
    if same_socket or same_port:
        raise SecurityConfigError(
            f"--admin-listen {text} is the worker listener; admin RPCs need their own listener"
        )
    return address


def host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` → (host, port); the host defaults to loopback."""
    if text.isdigit():
        text = f":{text}"
    address = parse_address(text)
    if address.kind != "tcp":
        raise ListenError(f"{text!r}: expected HOST:PORT")
    return address.host, address.port


def bind(
    server: grpc.Server,
    address: Address,
    tls: TlsMaterial | None,
    what: str,
    *,
    group: bool = False,
) -> Address:
    """Add ``address`` to ``server`` (TLS when ``tls`` and TCP); the bound address.

    A Unix socket is created by the bind with the umask's mode; it is set at once
    (0600, 0660 with ``group``) so a umask of 000 never leaves it 0777.
    """
    try:
        if tls is not None and address.kind == "tcp":
            port = server.add_secure_port(address.grpc_target, tls.server_credentials())
        else:
            port = server.add_insecure_port(address.grpc_target)
    except RuntimeError as exc:
        raise ListenError(
            f"cannot listen on {address.grpc_target} ({what} listener): {exc}; "
            "is another weightd (or another program) already using it?"
        ) from None
    if address.kind == "tcp":
        return Address("tcp", host=address.host, port=port)
    restrict_socket(address.path, group=group)
    return address


def admin_server(
    reloader: Reloader,
    observer: RpcObserver,
    allowed: frozenset[str] | None,
    adapters: Adapters | None = None,
    watchdog: StreamWatchdog | None = None,
    worker: Address | None = None,
    versions: Versions | None = None,
) -> grpc.Server:
    bounds = StreamBounds(watchdog, ADMIN_MAX_STREAMS, "admin")
    worker_target = worker.grpc_target if worker is not None else None
    return create_admin_server(
        reloader, observer, allowed, adapters, bounds, worker_target, versions
    )


#: Threads of the health listener, and the Watch streams it holds at most: the rest
#: always answer Check, whatever Watch clients do.
HEALTH_THREADS: Final = 6
HEALTH_MAX_WATCHES: Final = 2
ADMIN_MAX_STREAMS: Final = 1
#: Worker-listener threads kept for unary calls (Check, ListModels, DescribeModel)
#: on top of ``--max-workers``, which is the number of streams served at once.
RESERVED_THREADS: Final = 4


def worker_pool(max_workers: int) -> futures.ThreadPoolExecutor:
    """The worker listener's threads: ``max_workers`` for streams, a reserve for the rest."""
    return futures.ThreadPoolExecutor(
        max_workers=max_workers + RESERVED_THREADS, thread_name_prefix="weightd-rpc"
    )


def health_server(
    servicer: health.HealthServicer,
    observer: RpcObserver,
    watchdog: StreamWatchdog | None,
    worker: StreamBounds,
) -> grpc.Server:
    """A plaintext gRPC server with only grpc.health.v1: what kubelet gRPC probes can reach.

    Its own small pool, with Watch streams bounded below it (see :mod:`..rpc.health`).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="weightd-health"),
        interceptors=[
            observer,
            RequestGuard(),
            StreamBounds(watchdog, HEALTH_MAX_WATCHES, "health"),
        ],
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", 4 << 10),
            *connection_options(SMALL_LISTENER_CONNECTIONS, SMALL_LISTENER_IDLE_SECONDS),
        ],
        maximum_concurrent_rpcs=16,
    )
    health_pb2_grpc.add_HealthServicer_to_server(ListenerHealth(servicer, worker), server)
    return server


def enable_reflection(server: grpc.Server) -> None:
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection

    from weightd.v1 import weightd_pb2 as pb

    names = (
        pb.DESCRIPTOR.services_by_name["Weights"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)


def model_resolver(registry: ModelRegistry) -> Callable[[str], str | None]:
    """Map a request's model field to an operator-configured name, or None (bounded labels)."""

    def resolve(name: str) -> str | None:
        names = registry.names()
        if not name:
            return names[0] if len(names) == 1 else None
        return name if name in names else None

    return resolve
