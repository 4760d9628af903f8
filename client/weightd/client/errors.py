"""Typed client errors. Each carries the gRPC status code and the daemon's detail.

Callers catch the class for the situation (``ModelNotFoundError``, ``DataLossError``)
or the base :class:`WeightdError` for all; nothing is swallowed or turned into a
boolean. Errors the client itself detects (a digest mismatch, a stream cut short)
use the same classes with the code the daemon would have used.
"""

from __future__ import annotations

import grpc


class WeightdError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    #: Set when the failure is a same-host transport's own ("shm", "cuda_ipc"): the
    #: request itself is fine and gRPC may serve it. None: the request failed.
    transport: str | None = None

    def __init__(
        self, detail: str, code: grpc.StatusCode | None = None, *, transport: str | None = None
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code = code
        self.transport = transport

    def __str__(self) -> str:
        return f"{self.code.name}: {self.detail}"


class NotFoundError(WeightdError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidArgumentError(WeightdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(WeightdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class VocabPadUnsupportedError(FailedPreconditionError):
    """A fetch asked for ``Layout.vocab_pad`` and the daemon predates it.

    Such a daemon ignores the field and cuts vocabulary-parallel tensors in equal
    blocks; the client refuses the stream rather than hand out other rows than asked
    for. Fetch with ``vocab_pad=0`` and re-cut, or upgrade the daemon.
    """


class DataLossError(WeightdError):
    code = grpc.StatusCode.DATA_LOSS


class DigestMismatchError(DataLossError):
    """A slice the client received does not hash to the digest the daemon sent.

    Raised by the client's own check. A gRPC fetch of model weights that meets one
    asks once more with ``FetchRequest.rehash`` set, so the daemon checks its bytes
    itself (``weightd.client.resumable``): the error a caller sees is then the
    daemon's (the file changed: the model is marked broken), or this one again if the
    daemon's bytes were right and the second copy still arrived wrong. An adapter
    fetch raises it at once: the daemon digests every adapter slice as it sends it.
    """


class ResourceExhaustedError(WeightdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(WeightdError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(WeightdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class AbortedError(WeightdError):
    """A resumed fetch named content the daemon no longer serves; fetch from the start."""

    code = grpc.StatusCode.ABORTED


class PermissionDeniedError(WeightdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(WeightdError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[WeightdError]] = {
    cls.code: cls
    for cls in (
        NotFoundError,
        InvalidArgumentError,
        FailedPreconditionError,
        DataLossError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        PermissionDeniedError,
        UnauthenticatedError,
        AbortedError,
    )
}


def from_rpc_error(error: grpc.RpcError) -> WeightdError:
    """The typed error for a failed call (``error`` must be a ``grpc.Call``)."""
    code: grpc.StatusCode = error.code()
    detail: str = error.details() or ""
    cls = _BY_CODE.get(code, WeightdError)
    return cls(detail, code)


_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_for(code: int, detail: str, *, transport: str | None = None) -> WeightdError:
    """The typed error for a status number (as the side channel sends it)."""
    status = _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(status, WeightdError)(detail, status, transport=transport)
