"""Failures as gRPC statuses: the one conversion every servicer and guard uses.

The code itself comes from the error hierarchy's table
(:func:`weightd.server.base.errors.error_status`); this module only turns it into
``grpc.StatusCode`` and ends the call, with the error's class and fields as a
``google.rpc.ErrorInfo`` in the rich status (the ``grpc-status-details-bin``
trailer): reason = the class name, domain ``weightd.dev``, metadata = its fields. A
client that reads it acts on the situation; one that does not still has the code and
the text. A failure that is not a ``WeightdError`` is a bug: it answers INTERNAL with
a detail that says so, and its traceback goes to the log here, once, whichever
servicer it came from.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Final, NoReturn, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from ..base.errors import ERROR_DOMAIN, Code, ErrorStatus, error_status, status_for

log = logging.getLogger("weightd.rpc")

Self = TypeVar("Self")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


def grpc_code(code: Code) -> grpc.StatusCode:
    return grpc.StatusCode[code.name]


def grpc_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status ``error`` answers with (pure)."""
    code, detail = status_for(error)
    return grpc_code(code), detail


#: The trailer gRPC's rich status travels in (what ``grpcio-status`` reads and writes).
DETAILS_KEY: Final = "grpc-status-details-bin"


@dataclasses.dataclass(frozen=True)
class RichStatus(grpc.Status):
    """A status with trailing metadata, as ``ServicerContext.abort_with_status`` takes it."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, bytes], ...]


def rich_status(status: ErrorStatus) -> RichStatus:
    """``status`` as gRPC sends it: code, detail, and a ``google.rpc.Status`` holding the
    ErrorInfo in the ``grpc-status-details-bin`` trailer (pure)."""
    info = error_details_pb2.ErrorInfo(
        reason=status.reason, domain=ERROR_DOMAIN, metadata=status.metadata
    )
    packed = any_pb2.Any()
    packed.Pack(info)
    proto = status_pb2.Status(code=int(status.code), message=status.detail, details=[packed])
    raw: bytes = proto.SerializeToString()
    return RichStatus(grpc_code(status.code), status.detail, ((DETAILS_KEY, raw),))


def abort(context: grpc.ServicerContext, error: BaseException, method: str) -> NoReturn:
    """End the call with ``error``'s status; an unexplained failure is logged first."""
    status = error_status(error)
    if status.code is Code.INTERNAL:
        log.error("%s failed", method, exc_info=error)
    context.abort_with_status(rich_status(status))
    raise AssertionError("unreachable: ServicerContext.abort_with_status raises")


def unary(
    fn: Callable[[Self, Req, grpc.ServicerContext], Resp],
) -> Callable[[Self, Req, grpc.ServicerContext], Resp]:
    """A unary handler whose every failure becomes its status through :func:`abort`."""

    @functools.wraps(fn)
    def wrapper(self: Self, request: Req, context: grpc.ServicerContext) -> Resp:
        try:
            return fn(self, request, context)
        except Exception as exc:
            abort(context, exc, fn.__name__)

    return wrapper
