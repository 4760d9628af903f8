"""Who a client is, for the bounds on what one client may make the daemon keep.

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

from collections.abc import Iterable, Mapping

import grpc

from .guards import identities_from_auth_context


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
