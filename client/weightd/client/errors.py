"""Typed client errors. Each carries the gRPC status code and the daemon's detail.

Callers catch the class for the situation (``NotFoundError``, ``DataLossError``)
or the base :class:`WeightdError` for all; nothing is swallowed or turned into a
boolean. Errors the client itself detects (a digest mismatch, a stream cut short)
use the same classes with the code the daemon would have used.
"""

from __future__ import annotations

import grpc


class WeightdError(Exception):
    """Base of every error the client raises: catch it for all of them.

    ``code`` is the gRPC status code (the daemon's, or the one it would have used for
    what the client detects itself), ``detail`` the daemon's message, which names the
    model, tensor or field at fault. ``transport`` is set (``"shm"``, ``"cuda_ipc"``)
    when a same-host transport failed on its own: the request is fine and gRPC may
    serve it. ``str(error)`` is ``"CODE: detail"``.
    """

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
    """No such model, tensor or adapter on this daemon (``NOT_FOUND``)."""

    code = grpc.StatusCode.NOT_FOUND


class InvalidArgumentError(WeightdError):
    """The request itself is wrong: a rank out of range, a layout the model cannot be cut
    into, an unknown digest kind, a tensor another worker holds (``INVALID_ARGUMENT``).
    Asking again unchanged fails again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(WeightdError):
    """The daemon cannot do this for this model in its present state: no sharding rules
    for its architecture above world size 1, a pack reference from an earlier daemon
    boot, a placement the daemon does not offer (``FAILED_PRECONDITION``)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class VocabPadUnsupportedError(FailedPreconditionError):
    """A fetch asked for ``Layout.vocab_pad`` and the daemon predates it.

    Such a daemon ignores the field and cuts vocabulary-parallel tensors in equal
    blocks; the client refuses the stream rather than hand out other rows than asked
    for. Fetch with ``vocab_pad=0`` and re-cut, or upgrade the daemon.
    """


class DataLossError(WeightdError):
    """Bytes that do not match their verified digest, or a stream cut short
    (``DATA_LOSS``): nothing of the failed fetch is returned."""

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
    """A limit was reached: concurrent RPCs or streams, a request or name bound, a
    shared-memory or adapter budget (``RESOURCE_EXHAUSTED``). Retryable with backoff
    (:class:`~weightd.client.retry.RetryPolicy`)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(WeightdError):
    """The daemon cannot answer now: still verifying, draining, or not reachable at all
    (``UNAVAILABLE``). Retryable with backoff."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(WeightdError):
    """A call ran past its timeout, or a stream past the daemon's ``--max-stream-seconds``
    (``DEADLINE_EXCEEDED``)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class AbortedError(WeightdError):
    """A resumed fetch named content the daemon no longer serves; fetch from the start."""

    code = grpc.StatusCode.ABORTED


class PermissionDeniedError(WeightdError):
    """The caller may not do this here: an admin call on the worker listener, an admin
    client certificate not allowed, a path outside the adapter roots
    (``PERMISSION_DENIED``)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(WeightdError):
    """An admin call over TCP without a client identity the daemon can read
    (``UNAUTHENTICATED``)."""

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
