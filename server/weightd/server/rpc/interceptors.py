"""The RPC observer: one server interceptor that counts, times and tracks every RPC.

Why an interceptor: the servicers stay thin and unaware of metrics, and every
service (weights, health, reflection, admin) is measured the same way. It also
keeps the count of RPCs in flight that a graceful drain waits for.

Labels stay bounded: only methods that have a handler are observed (a client's
made-up method name gets UNIMPLEMENTED from gRPC and is never a label), and the
model label of bytes served is resolved against the operator's model list.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc

from ..telemetry.metrics import Metrics
from .wire import WEIGHTS_SERVICE, payload_bytes

Behavior = Callable[[Any, grpc.ServicerContext], Any]
if TYPE_CHECKING:
    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]
else:  # not subscriptable at run time
    Handler = grpc.RpcMethodHandler

FETCH_METHOD: Final = f"/{WEIGHTS_SERVICE}/Fetch"

#: Long-lived streams that a drain does not wait for: they never end by themselves
#: (a health Watch follows status changes forever), so waiting would always cost the
#: whole grace period. They are cancelled when the drain ends.
DRAIN_EXEMPT: Final = frozenset(
    {
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)


def split_method(full: str) -> tuple[str, str]:
    """``/pkg.Service/Method`` → ``("pkg.Service", "Method")`` (pure)."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method


def status_of(context: grpc.ServicerContext) -> grpc.StatusCode | None:
    """The code the RPC will end with, as set by ``abort``/``set_code`` (None: not set).

    ``ServicerContext.code()`` exists at run time (grpcio ≥ 1.38) but not in the stubs.
    """
    code = getattr(context, "code", None)
    value = code() if callable(code) else None
    return value if isinstance(value, grpc.StatusCode) else None


def rewrap(
    handler: Handler,
    unary: Callable[[Behavior], Behavior],
    stream: Callable[[Behavior], Behavior],
    *,
    requests_unary: Callable[[Behavior], Behavior] | None = None,
    requests_stream: Callable[[Behavior], Behavior] | None = None,
    deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    """The same handler with its behavior wrapped: ``unary`` for single responses,
    ``stream`` for streamed ones, whatever the requests; an interceptor that treats
    request streams apart gives ``requests_unary`` / ``requests_stream`` too. The
    response serializer is kept; ``deserializer`` replaces the request's when given.

    One place builds the four handler kinds, so every interceptor (requests, guards,
    stream bounds, metrics) wraps each kind and none forgets one.
    """
    des = deserializer or handler.request_deserializer
    ser = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), des, ser)
    if handler.stream_unary is not None:
        wrap = requests_unary or unary
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), des, ser)
    assert handler.stream_stream is not None
    wrap = requests_stream or stream
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), des, ser)


class InflightTracker:
    """Counts RPCs in flight (except :data:`DRAIN_EXEMPT` streams) so a drain can wait."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    @property
    def count(self) -> int:
        with self._cond:
            return self._count

    def enter(self) -> None:
        with self._cond:
            self._count += 1

    def exit(self) -> None:
        with self._cond:
            self._count -= 1
            if self._count == 0:
                self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing is in flight; False if ``timeout`` seconds passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count == 0, timeout)


class RpcObserver(grpc.ServerInterceptor):
    """Counts RPCs by method and code, times Fetch, counts bytes served, tracks streams."""

    def __init__(
        self,
        metrics: Metrics | None,
        tracker: InflightTracker,
        resolve_model: Callable[[str], str | None] = lambda name: None,
    ) -> None:
        self._metrics = metrics
        self._tracker = tracker
        self._resolve = resolve_model

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED; never a label
        full = handler_call_details.method
        tracked = full not in DRAIN_EXEMPT
        service, method = split_method(full)
        return rewrap(
            handler,
            lambda b: self._unary(b, service, method, tracked),
            lambda b: self._stream(b, full, service, method, tracked),
        )

    def _track(self, context: grpc.ServicerContext) -> None:
        """Count the RPC as in flight until gRPC itself says it ended.

        Not when the handler returns: the last messages and the status may still be
        queued behind flow control, and a drain that cancelled "finished" calls then
        would cut a client off just before its last bytes.
        """
        self._tracker.enter()
        if not context.add_callback(self._tracker.exit):
            self._tracker.exit()  # already over

    def _done(self, service: str, method: str, code: grpc.StatusCode) -> None:
        if self._metrics is not None:
            self._metrics.rpcs.labels(service, method, code.name).inc()

    def _unary(self, behavior: Behavior, service: str, method: str, tracked: bool) -> Behavior:
        def observed(request: Any, context: grpc.ServicerContext) -> Any:
            if tracked:
                self._track(context)
            code = grpc.StatusCode.OK
            try:
                return behavior(request, context)
            except BaseException:
                code = status_of(context) or grpc.StatusCode.UNKNOWN
                raise
            finally:
                self._done(service, method, status_of(context) or code)

        return observed

    def _stream(
        self, behavior: Behavior, full: str, service: str, method: str, tracked: bool
    ) -> Behavior:
        is_fetch = full == FETCH_METHOD

        def observed(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if tracked:
                self._track(context)
            gauge = None
            if self._metrics is not None:
                gauge = self._metrics.active_streams.labels(service, method)
                gauge.inc()
            started = time.monotonic()
            code = grpc.StatusCode.OK
            sent = 0
            inner = behavior(request, context)
            try:
                for response in inner:
                    if is_fetch:
                        sent += payload_bytes(response)
                    yield response
            except GeneratorExit:
                code = grpc.StatusCode.CANCELLED  # the client went away mid-stream
                raise
            except BaseException:
                code = status_of(context) or grpc.StatusCode.UNKNOWN
                raise
            finally:
                inner.close()
                if code is grpc.StatusCode.OK and not context.is_active():
                    code = grpc.StatusCode.CANCELLED
                code = status_of(context) or code
                if gauge is not None:
                    gauge.dec()
                self._done(service, method, code)
                if is_fetch and self._metrics is not None:
                    self._fetch_done(request, sent, code, time.monotonic() - started)

        return observed

    def _fetch_done(self, request: Any, sent: int, code: grpc.StatusCode, seconds: float) -> None:
        assert self._metrics is not None
        model = self._resolve(getattr(request, "model", ""))
        if sent and model is not None:
            self._metrics.served_bytes.labels("grpc", model).inc(sent)
        if code is grpc.StatusCode.OK:
            self._metrics.fetch_seconds.labels("grpc").observe(seconds)
