"""Interceptors that refuse: admin calls where they don't belong, callers without an
allowed identity. (Request fields are bounded by :mod:`.requests`, streams by
:mod:`.streams`.)

Each refusal is a typed error from :mod:`weightd.server.base.errors`, so its status code comes from
:func:`~weightd.server.base.errors.status_for` like every other failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import grpc

from weightd.common.addresses import Address
from weightd.v1 import weightd_pb2 as pb

from ..base.errors import AdminOnly, PermissionDenied, Unauthenticated, WeightdError
from .interceptors import Behavior, Handler, rewrap
from .status import abort
from .wire import ADMIN_SERVICE

log = logging.getLogger("weightd.guards")

_ADMIN = pb.DESCRIPTOR.services_by_name["Admin"]
#: Every Admin method, from the proto: the only method names the gate recognises.
ADMIN_METHODS: Final = {f"/{ADMIN_SERVICE}/{m.name}": m.server_streaming for m in _ADMIN.methods}


# --- admin -----------------------------------------------------------------------------


class AdminGate(grpc.ServerInterceptor):
    """On the worker listener: every Admin method is :class:`AdminOnly`
    (PERMISSION_DENIED), naming the admin listener (``admin``; None: there is none).

    Without it a worker would get UNIMPLEMENTED, which reads like a version mismatch
    rather than "wrong door".
    """

    def __init__(self, admin: Address | None = None) -> None:
        self._admin = admin.grpc_target if admin is not None else None

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        if method not in ADMIN_METHODS:
            return continuation(handler_call_details)
        where = (
            f"connect to the admin listener at {self._admin}"
            if self._admin
            else "this daemon runs no admin listener (--admin-listen none)"
        )
        error = AdminOnly(
            f"{method} is an admin RPC and this is the daemon's worker listener: {where}",
            admin=self._admin or "",
        )

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            abort(context, error, method)

        def deny_stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            abort(context, error, method)  # raises: gRPC takes it as the stream's status

        if ADMIN_METHODS[method]:
            return grpc.unary_stream_rpc_method_handler(deny_stream)
        return grpc.unary_unary_rpc_method_handler(deny)


def identities_from_auth_context(auth: Mapping[str, Iterable[bytes]]) -> list[str]:
    """The client certificate's common name and subject alternative names (pure)."""
    out: list[str] = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth.get(key, ()):
            text = value.decode("utf-8", "replace")
            if text not in out:
                out.append(text)
    return out


def authorize(identities: Sequence[str], allowed: frozenset[str]) -> str:
    """The allowed identity the caller holds; :class:`Unauthenticated` without any
    identity, :class:`PermissionDenied` when none of them is allowed (pure)."""
    if not identities:
        raise Unauthenticated(
            "admin RPCs over TCP need a client certificate (mutual TLS); none was presented"
        )
    for identity in identities:
        if identity in allowed:
            return identity
    raise PermissionDenied(
        f"client identity {', '.join(identities)} is not allowed to call admin RPCs "
        "(see --admin-allow)"
    )


class AdminAuthorizer(grpc.ServerInterceptor):
    """On the admin listener: checks who calls.

    ``allowed`` None means the transport already authenticated the caller: a Unix
    socket in a 0700 directory only this user (and root) can reach. Otherwise the
    client certificate's CN/SANs must include one of ``allowed``.
    """

    def __init__(self, allowed: frozenset[str] | None) -> None:
        self._allowed = allowed

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or self._allowed is None:
            return handler
        allowed = self._allowed
        method = handler_call_details.method

        def check(context: grpc.ServicerContext) -> None:
            auth: Mapping[str, Iterable[bytes]] = context.auth_context()  # type: ignore[assignment]
            try:
                who = authorize(identities_from_auth_context(auth), allowed)
            except WeightdError as exc:
                log.warning("admin call %s from %s refused: %s", method, context.peer(), exc)
                abort(context, exc, method)
            log.info("admin call %s by %s", method, who)

        def unary(behavior: Behavior) -> Behavior:
            def checked(request: Any, context: grpc.ServicerContext) -> Any:
                check(context)
                return behavior(request, context)

            return checked

        def stream(behavior: Behavior) -> Behavior:
            def checked(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                check(context)
                yield from behavior(request, context)

            return checked

        return rewrap(handler, unary, stream)
