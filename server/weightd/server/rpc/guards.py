"""Interceptors that refuse: admin calls where they don't belong, callers without an
allowed identity, oversized requests and streams that outlive the daemon's cap.

Each refusal is a typed error from :mod:`weightd.server.base.errors`, so its status code comes from
:func:`~weightd.server.base.errors.status_for` like every other failure.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import grpc

from weightd.v1 import weightd_pb2 as pb

from ..base.errors import (
    PermissionDenied,
    RequestTooLarge,
    StreamTimeLimit,
    Unauthenticated,
    WeightdError,
)
from .interceptors import FETCH_METHOD, Behavior, Handler, rewrap
from .status import abort
from .wire import ADMIN_SERVICE

log = logging.getLogger("weightd.guards")

_ADMIN = pb.DESCRIPTOR.services_by_name["Admin"]
#: Every Admin method, from the proto: the only method names the gate recognises.
ADMIN_METHODS: Final = {f"/{ADMIN_SERVICE}/{m.name}": m.server_streaming for m in _ADMIN.methods}

#: Request bounds. gRPC already caps a request at 1 MiB (``max_receive_message_length``);
#: these say precisely which field is too big instead of a bare size error.
MAX_FETCH_NAMES: Final = 1 << 16
MAX_NAME_BYTES: Final = 1024
MAX_MODEL_NAME_BYTES: Final = 256


# --- request bounds ------------------------------------------------------------------


def check_fetch_bounds(model: str, names: Sequence[str]) -> None:
    """Raise :class:`RequestTooLarge` naming the field that exceeds its bound (pure)."""
    if len(model.encode()) > MAX_MODEL_NAME_BYTES:
        raise RequestTooLarge(
            f"model name is {len(model.encode())} bytes; the limit is {MAX_MODEL_NAME_BYTES}"
        )
    if len(names) > MAX_FETCH_NAMES:
        raise RequestTooLarge(
            f"request names {len(names)} tensors; the limit is {MAX_FETCH_NAMES} per fetch"
        )
    for name in names:
        if len(name.encode()) > MAX_NAME_BYTES:
            raise RequestTooLarge(
                f"tensor name {name[:40]!r}... is {len(name.encode())} bytes; "
                f"the limit is {MAX_NAME_BYTES}"
            )


# --- admin -----------------------------------------------------------------------------


class AdminGate(grpc.ServerInterceptor):
    """On the worker listener: every Admin method is PERMISSION_DENIED, with the reason.

    Without it a worker would get UNIMPLEMENTED, which reads like a version mismatch
    rather than "wrong door".
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        if method not in ADMIN_METHODS:
            return continuation(handler_call_details)
        error = PermissionDenied(
            f"{method} is an admin RPC; it is served only on the daemon's admin listener "
            "(--admin-listen), never on the worker listener"
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


# --- fetch streams ------------------------------------------------------------------------


class StreamWatchdog:
    """Cancels streams that outlive ``max_seconds``, even one blocked on a slow reader.

    A handler blocked in ``yield`` (the client stopped reading; flow control holds the
    send) cannot check a clock, so one thread watches every stream's deadline and
    cancels the call ``slack_seconds`` after the cap. Streams that keep moving are
    stopped at the cap itself, more politely, by :class:`FetchGuard` with
    DEADLINE_EXCEEDED and a reason; the slack leaves that path its chance first.
    """

    def __init__(self, max_seconds: float, slack_seconds: float = 5.0) -> None:
        self.max_seconds = max_seconds
        self.slack_seconds = slack_seconds
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, tuple[grpc.ServicerContext, str]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, context: grpc.ServicerContext, what: str) -> int:
        token = next(self._ids)
        with self._cond:
            self._live[token] = (context, what)
            deadline = time.monotonic() + self.max_seconds + self.slack_seconds
            heapq.heappush(self._heap, (deadline, token))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="weightd-stream-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return token

    def release(self, token: int) -> None:
        with self._cond:
            self._live.pop(token, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            expired: list[tuple[grpc.ServicerContext, str]] = []
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                while self._heap and (
                    self._heap[0][0] <= now or self._heap[0][1] not in self._live
                ):
                    _, token = heapq.heappop(self._heap)
                    live = self._live.pop(token, None)
                    if live is not None:
                        expired.append(live)
                if not expired:
                    wait = self._heap[0][0] - now if self._heap else None
                    self._cond.wait(wait)
                    continue
            for context, what in expired:
                log.warning(
                    "%s ran past the %.0fs stream limit while blocked; cancelling it",
                    what,
                    self.max_seconds,
                )
                context.cancel()


class FetchGuard(grpc.ServerInterceptor):
    """Bounds each Fetch: request fields (RESOURCE_EXHAUSTED) and duration (DEADLINE_EXCEEDED)."""

    def __init__(self, watchdog: StreamWatchdog | None) -> None:
        self._watchdog = watchdog

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method != FETCH_METHOD:
            return handler
        return rewrap(handler, lambda b: b, self._guard)

    def _guard(self, behavior: Behavior) -> Behavior:
        watchdog = self._watchdog

        def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                check_fetch_bounds(request.model, request.names)
            except WeightdError as exc:
                abort(context, exc, "Fetch")
            if watchdog is None:
                yield from behavior(request, context)
                return
            started = time.monotonic()
            token = watchdog.watch(context, f"Fetch from {context.peer()}")
            inner = behavior(request, context)
            try:
                for response in inner:
                    if time.monotonic() - started > watchdog.max_seconds:
                        abort(
                            context,
                            StreamTimeLimit(
                                f"fetch stream ran past the daemon's {watchdog.max_seconds:g}s "
                                "limit (--max-stream-seconds); fetch fewer tensors per call"
                            ),
                            "Fetch",
                        )
                    yield response
            finally:
                inner.close()
                watchdog.release(token)

        return guarded
