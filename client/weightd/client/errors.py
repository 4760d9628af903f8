"""Typed client errors. Each carries the gRPC status code and the daemon's detail.

Callers catch the class for the situation (``ModelNotFoundError``, ``DataLossError``)
or the base :class:`WeightdError` for all; nothing is swallowed or turned into a
boolean. Errors the client itself detects (a digest mismatch, a stream cut short)
use the same classes with the code the daemon would have used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

#: gRPC status codes by number (``grpc.StatusCode``'s names), so that an error from the
#: side socket is typed without importing gRPC: a same-host fetch never loads it.
STATUS_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)


class WeightdError(Exception):
    #: The status code's name (a ``grpc.StatusCode`` member's); :attr:`code` is the member.
    code_name: str = "UNKNOWN"
    #: Set when the failure is a same-host transport's own ("shm", "cuda_ipc"): the
    #: request itself is fine and gRPC may serve it. None: the request failed.
    transport: str | None = None

    def __init__(
        self,
        detail: str,
        code: grpc.StatusCode | str | None = None,
        *,
        transport: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code_name = code if isinstance(code, str) else code.name
        self.transport = transport

    @property
    def code(self) -> grpc.StatusCode:
        """The ``grpc.StatusCode`` (gRPC is imported on first use, not with the client)."""
        import grpc

        found: grpc.StatusCode = getattr(grpc.StatusCode, self.code_name, grpc.StatusCode.UNKNOWN)
        return found

    def __str__(self) -> str:
        return f"{self.code_name}: {self.detail}"


class NotFoundError(WeightdError):
    code_name = "NOT_FOUND"


class InvalidArgumentError(WeightdError):
    code_name = "INVALID_ARGUMENT"


class FailedPreconditionError(WeightdError):
    code_name = "FAILED_PRECONDITION"


class VocabPadUnsupportedError(FailedPreconditionError):
    """A fetch asked for ``Layout.vocab_pad`` and the daemon predates it.

    Such a daemon ignores the field and cuts vocabulary-parallel tensors in equal
    blocks; the client refuses the stream rather than hand out other rows than asked
    for. Fetch with ``vocab_pad=0`` and re-cut, or upgrade the daemon.
    """


class DataLossError(WeightdError):
    code_name = "DATA_LOSS"


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
    code_name = "RESOURCE_EXHAUSTED"


class UnavailableError(WeightdError):
    code_name = "UNAVAILABLE"


class DeadlineExceededError(WeightdError):
    code_name = "DEADLINE_EXCEEDED"


class AbortedError(WeightdError):
    """A resumed fetch named content the daemon no longer serves; fetch from the start."""

    code_name = "ABORTED"


class PermissionDeniedError(WeightdError):
    code_name = "PERMISSION_DENIED"


class UnauthenticatedError(WeightdError):
    code_name = "UNAUTHENTICATED"


_BY_NAME: dict[str, type[WeightdError]] = {
    cls.code_name: cls
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
    cls = _BY_NAME.get(code.name, WeightdError)
    return cls(detail, code)


def error_for(code: int, detail: str, *, transport: str | None = None) -> WeightdError:
    """The typed error for a status number (as the side channel sends it)."""
    name = STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "UNKNOWN"
    return _BY_NAME.get(name, WeightdError)(detail, name, transport=transport)
