"""Failures as gRPC statuses: the one conversion every servicer and guard uses.

The code itself comes from the error hierarchy's table
(:func:`weightd.server.base.errors.status_for`); this module only turns it into
``grpc.StatusCode`` and ends the call. A failure that is not a ``WeightdError`` is a
bug: it answers INTERNAL with a detail that says so, and its traceback goes to the log
here, once, whichever servicer it came from.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from ..base.errors import Code, status_for

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


def abort(context: grpc.ServicerContext, error: BaseException, method: str) -> NoReturn:
    """End the call with ``error``'s status; an unexplained failure is logged first."""
    code, detail = status_for(error)
    if code is Code.INTERNAL:
        log.error("%s failed", method, exc_info=error)
    context.abort(grpc_code(code), detail)
    raise AssertionError("unreachable: ServicerContext.abort raises")


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
