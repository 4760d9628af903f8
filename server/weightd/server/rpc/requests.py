"""Every request, on every listener, is decoded and bounded before a handler sees it.

Two caller mistakes used to come back as the daemon's own fault:

* **Undecodable bytes.** gRPC calls a method's request deserializer before any
  interceptor behaviour runs; when it raises, gRPC logs "Exception deserializing
  request!" with a traceback and answers INTERNAL, and the call is never counted in
  ``weightd_rpcs_total``. :class:`RequestGuard` wraps each deserializer so a decode
  failure becomes a value, and the handler answers it with INVALID_ARGUMENT naming the
  message type: one log-free refusal, counted like every other.
* **Unbounded strings.** A 900 KB model name fits in a 1 MiB request; it was echoed
  back whole in the error detail (and the client then saw "Stream removed" instead of
  the error). :func:`~weightd.server.base.bounds.check_fields` bounds every string of
  every request (the side channel's too) by its field name.

Installed right after the observer on each server, so its refusals are counted and
they happen before any guard or servicer reads a field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from ..base.bounds import check_fields
from ..base.errors import InvalidRequest
from .interceptors import Behavior, Handler, rewrap
from .status import abort


class Undecodable:
    """What a request deserializer returns for bytes that are not its message."""

    __slots__ = ("problem",)

    def __init__(self, problem: str) -> None:
        self.problem = problem


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError and whatever a parser raises on junk
            return Undecodable(f"{type(exc).__name__}: {exc}")

    return decode


def _admit(request: Any, method: str) -> None:
    """Refuse an undecodable or oversized request (raises a typed error)."""
    if isinstance(request, Undecodable):
        raise InvalidRequest(f"request to {method} is not a valid message ({request.problem})")
    if isinstance(request, Message):
        check_fields(request)


class RequestGuard(grpc.ServerInterceptor):
    """Decodes requests without raising, and refuses undecodable or oversized ones."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        return rewrap(
            handler,
            lambda b: self._unary(b, method),
            lambda b: self._stream(b, method),
            requests_unary=lambda b: self._requests_unary(b, method),
            requests_stream=lambda b: self._requests_stream(b, method),
            deserializer=_safe(handler.request_deserializer),
        )

    @staticmethod
    def _unary(behavior: Behavior, method: str) -> Behavior:
        def guarded(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                _admit(request, method)
            except Exception as exc:
                abort(context, exc, method)
            return behavior(request, context)

        return guarded

    @staticmethod
    def _stream(behavior: Behavior, method: str) -> Behavior:
        def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                _admit(request, method)
            except Exception as exc:
                abort(context, exc, method)
            yield from behavior(request, context)

        return guarded

    @staticmethod
    def _checked(
        requests: Iterator[Any], method: str, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        for request in requests:
            try:
                _admit(request, method)
            except Exception as exc:
                abort(context, exc, method)
            yield request

    def _requests_unary(self, behavior: Behavior, method: str) -> Behavior:
        def guarded(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            return behavior(self._checked(requests, method, context), context)

        return guarded

    def _requests_stream(self, behavior: Behavior, method: str) -> Behavior:
        def guarded(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            yield from behavior(self._checked(requests, method, context), context)

        return guarded
