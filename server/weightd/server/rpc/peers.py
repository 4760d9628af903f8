"""Who a client is, and how many connections a listener keeps: the bounds on what one
client may make the daemon keep that live at the connection.

A request's own fields (a hold's ``holder``) are the client's choice, so a bound keyed
on them is no bound. What a client cannot forge in a request is its connection, as
gRPC reports it: ``context.peer()`` and, over mutual TLS, the certificate's identity.
From those (pure, :func:`client_key`):

* **TCP**: the peer's address without its port (a client gets no fresh identity by
  opening another connection), plus the certificate's first identity over mutual TLS;
* **Unix socket**: one client, ``unix``. gRPC's Python server reports no peer
  credentials for a Unix socket (``peer()`` is ``unix:`` for every connection; there
  is no ``SO_PEERCRED``), and whoever may connect is the daemon's own user, or its
  group with ``socket-group-access``: processes that could already signal or trace
  each other, so sharing one bound costs them nothing they had.

The bounds that use it never refuse a request for want of room: they end the
heaviest client's oldest holding instead (see :mod:`weightd.server.registry.versions`).
"""

from __future__ import annotations

import resource
from collections.abc import Iterable, Mapping
from typing import Final

import grpc

from .guards import identities_from_auth_context

#: The most connections the worker listener keeps by default (``server.max_connections`` 0).
MAX_CONNECTIONS_DEFAULT: Final = 4096
#: Connections and idle seconds of the small listeners (health, admin): a probe or an
#: operator needs a few; an unauthenticated flood must not take the daemon's descriptors.
SMALL_LISTENER_CONNECTIONS: Final = 64
SMALL_LISTENER_IDLE_SECONDS: Final = 60.0


def client_key(peer: str, auth: Mapping[str, Iterable[bytes]]) -> str:
    """The client a connection is counted as (pure; see the module docstring)."""
    kind, _, rest = peer.partition(":")
    if kind == "unix" or not rest:
        host = "unix"
    elif kind in ("ipv4", "ipv6"):
        host = f"{kind}:{rest.rpartition(':')[0] or rest}"
    else:
        host = peer
    identities = identities_from_auth_context(auth)
    return f"{host} {identities[0]}" if identities else host


def client_of(context: grpc.ServicerContext) -> str:
    """The client the RPC in ``context`` is counted as."""
    auth: Mapping[str, Iterable[bytes]] = context.auth_context()  # type: ignore[assignment]
    return client_key(context.peer(), auth)


def connection_options(max_connections: int, idle_seconds: float) -> list[tuple[str, int]]:
    """gRPC options bounding the connections a listener keeps.

    ``max_connections`` (0: a quarter of the open-file limit, at most
    :data:`MAX_CONNECTIONS_DEFAULT`): past it gRPC closes new connections at once, so a
    client that opens connections in a loop cannot take every descriptor the daemon
    needs for its shards, packs and side socket. ``idle_seconds``: a connection with
    no RPC for that long is closed (a client reconnects by itself), so idle ones do
    not hold slots. gRPC's server has no per-peer hook, so this bound is in total.
    """
    if max_connections <= 0:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = soft if soft != resource.RLIM_INFINITY else MAX_CONNECTIONS_DEFAULT * 4
        max_connections = max(16, min(MAX_CONNECTIONS_DEFAULT, limit // 4))
    options = [("grpc.max_allowed_incoming_connections", max_connections)]
    if idle_seconds > 0:
        options.append(("grpc.max_connection_idle_ms", int(idle_seconds * 1000)))
    return options
