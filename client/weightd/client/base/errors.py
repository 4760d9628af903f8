"""Typed client errors: one class per situation, all under :class:`WeightdError`.

The daemon sends every failure's class and fields with its status
(``google.rpc.ErrorInfo`` in gRPC's ``grpc-status-details-bin`` trailer; ``reason``
and ``metadata`` on the side channel). The client raises the matching class:

* a situation a caller acts on has a class of its own here (:class:`ModelNotFound`,
  :class:`NotServing`, :class:`LayoutRefused`, :class:`DigestMismatch`,
  :class:`AdminOnly`, ...), chosen in one table, :data:`REASONS`;
* every other daemon class arrives as a class of its own name (``HeaderSyntaxError``),
  made on first use under the nearest family the table knows (``CheckpointInvalid``
  for a ``HeaderError``), so ``type(error).__name__`` is always the daemon's reason;
* every class is still a subclass of its status code's class (:class:`NotFoundError`,
  :class:`FailedPreconditionError`, ...), so code written against those keeps working,
  and a daemon that predates the detail maps by code alone.

Each error has ``code``, ``detail`` (the daemon's words), ``reason`` (its class name,
"" from an old daemon) and ``metadata`` (its fields: model, tensor, path, uri, ...).
Catch the class for the situation, or :class:`WeightdError` for all; nothing is
swallowed or turned into a boolean. Errors the client itself detects (a digest
mismatch, a stream cut short, no daemon at the address) use the same classes. What
each one means and what to do: ``docs/guides/errors.md``.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:  # a same-host fetch never loads gRPC: codes are kept by name
    import grpc

#: gRPC status codes by number (``grpc.StatusCode``'s names), so that an error from the
#: side socket is typed without importing gRPC: a same-host fetch never loads it.
STATUS_NAMES: Final = (
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

#: ``ErrorInfo.domain`` of the daemon's statuses.
DOMAIN: Final = "weightd.dev"
#: Metadata key with the daemon class's ancestors, nearest first.
LINEAGE_KEY: Final = "error_lineage"
#: Most fields kept from one status (the daemon sends at most 12 and the lineage).
MAX_FIELDS: Final = 32


class WeightdError(Exception):
    """Base of every error the client raises: catch it for all of them.

    ``code`` is the gRPC status code (the daemon's, or the one it would have used for
    what the client detects itself), ``detail`` the daemon's message, which names the
    model, tensor or field at fault, ``reason`` the daemon's error class and
    ``metadata`` its fields. ``transport`` is set (``"shm"``, ``"cuda_ipc"``) when a
    same-host transport failed on its own: the request is fine and gRPC may serve it.
    ``str(error)`` is ``"CODE: detail"``.
    """

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
        reason: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        if code is not None:
            self.code_name = code if isinstance(code, str) else code.name
        self.transport = transport
        #: The daemon's error class ("" from a daemon that predates it, or the client's own).
        self.reason = reason
        #: The error's fields as the daemon sent them (model, tensor, path, ...).
        self.metadata: dict[str, str] = dict(metadata or {})

    @property
    def code(self) -> grpc.StatusCode:
        """The ``grpc.StatusCode`` (gRPC is imported on first use, not with the client)."""
        import grpc

        found: grpc.StatusCode = getattr(grpc.StatusCode, self.code_name, grpc.StatusCode.UNKNOWN)
        return found

    def __str__(self) -> str:
        return f"{self.code_name}: {self.detail}"

    def __reduce__(self) -> tuple[Any, ...]:
        # A class made for a reason is rebuilt through the table, so it pickles too
        # (vLLM hands a worker's exception to the engine process); the rest by class.
        cls = type(self)
        module = sys.modules.get(cls.__module__)
        static = cls if getattr(module, cls.__qualname__, None) is cls else None
        fields = (_number(self.code_name), self.detail, self.transport, self.reason, self.metadata)
        return (_rebuild, (static, *fields))


# --- one class per status code (what clients caught before reasons travelled) -----


class CancelledError(WeightdError):
    """The call was cancelled, by the caller or by the daemon draining (``CANCELLED``)."""

    code_name = "CANCELLED"


class InvalidArgumentError(WeightdError):
    """The request itself is wrong: a rank out of range, a layout the model cannot be cut
    into, an unknown digest kind, a tensor another worker holds (``INVALID_ARGUMENT``).
    Asking again unchanged fails again."""

    code_name = "INVALID_ARGUMENT"


class DeadlineExceededError(WeightdError):
    """A call ran past its timeout, or a stream past the daemon's ``--max-stream-seconds``
    (``DEADLINE_EXCEEDED``)."""

    code_name = "DEADLINE_EXCEEDED"


class NotFoundError(WeightdError):
    """No such model, tensor or adapter on this daemon (``NOT_FOUND``)."""

    code_name = "NOT_FOUND"


class AlreadyExistsError(WeightdError):
    """What the call would create exists already (``ALREADY_EXISTS``)."""

    code_name = "ALREADY_EXISTS"


class PermissionDeniedError(WeightdError):
    """The caller may not do this here: an admin call on the worker listener, an admin
    client certificate not allowed, a path outside the adapter roots
    (``PERMISSION_DENIED``)."""

    code_name = "PERMISSION_DENIED"


class ResourceExhaustedError(WeightdError):
    """A limit was reached: concurrent RPCs or streams, a request or name bound, a
    shared-memory or adapter budget (``RESOURCE_EXHAUSTED``). Retryable with backoff
    (:class:`~weightd.client.base.retry.RetryPolicy`)."""

    code_name = "RESOURCE_EXHAUSTED"


class FailedPreconditionError(WeightdError):
    """The daemon cannot do this for this model in its present state: no sharding rules
    for its architecture above world size 1, a pack reference from an earlier daemon
    boot, a placement the daemon does not offer (``FAILED_PRECONDITION``)."""

    code_name = "FAILED_PRECONDITION"


class AbortedError(WeightdError):
    """A resumed fetch named content the daemon no longer serves; fetch from the start."""

    code_name = "ABORTED"


class OutOfRangeError(WeightdError):
    """A position past the end of what the daemon holds (``OUT_OF_RANGE``)."""

    code_name = "OUT_OF_RANGE"


class UnimplementedError(WeightdError):
    """The peer does not implement this call: an older daemon, or not weightd at all
    (``UNIMPLEMENTED``)."""

    code_name = "UNIMPLEMENTED"


class InternalError(WeightdError):
    """A bug in the daemon (its log has the traceback), or a peer's unexplained failure."""

    code_name = "INTERNAL"


class UnavailableError(WeightdError):
    """The daemon cannot answer now: still verifying, draining, or not reachable at all
    (``UNAVAILABLE``). Retryable with backoff."""

    code_name = "UNAVAILABLE"


class DataLossError(WeightdError):
    """Bytes that do not match their verified digest, or a stream cut short
    (``DATA_LOSS``): nothing of the failed fetch is returned."""

    code_name = "DATA_LOSS"


class UnauthenticatedError(WeightdError):
    """An admin call over TCP without a client identity the daemon can read
    (``UNAUTHENTICATED``)."""

    code_name = "UNAUTHENTICATED"


# --- situations ----------------------------------------------------------------------


class ModelNotFound(NotFoundError):
    """The daemon serves no model of that name (``metadata["model"]``); the detail lists
    the ones it serves."""


class TensorNotFound(NotFoundError):
    """The model has no tensor of that name (``metadata["tensor"]``)."""


class AdapterNotFound(NotFoundError):
    """No LoRA adapter of that name is loaded (never was, unloaded or evicted)."""


class NotServing(UnavailableError):
    """The model is known but not served yet (still verifying) or any more (draining):
    retry later (a :class:`~weightd.client.base.retry.RetryPolicy` does)."""


class DaemonUnreachable(UnavailableError):
    """No daemon answered at the address: no socket there, nothing listening, a name that
    does not resolve. The daemon was never asked; the message says what to check."""


class NotWeightd(UnavailableError):
    """Something answered at the address, but not gRPC: another program's socket."""


class MethodNotServed(UnimplementedError):
    """A gRPC server answered that it has no such method: not a weightd daemon, or the
    admin socket of one that predates :class:`WorkerOnly`."""


class WorkerOnly(UnimplementedError):
    """A worker call (fetch, list, describe) sent to the daemon's admin listener; the
    message names the worker socket to use instead."""


class AdminOnly(PermissionDeniedError):
    """An admin call (reload, adapter loads) sent to the worker listener; the message
    names the admin listener to use instead."""


class AccessDenied(PermissionDeniedError):
    """The caller is known but not allowed (a client certificate not in
    ``--admin-allow``)."""


class ModelChanged(AbortedError):
    """A resumed fetch names content the daemon no longer serves: fetch from the start."""


class DigestMismatch(DataLossError):
    """Bytes do not hash to their trusted digest. From the daemon: a file on its disk
    does not match the manifest (nothing is served). From the client's own check: a
    slice received does not hash to the digest the daemon sent.

    A gRPC fetch of model weights that meets the client-side case asks once more with
    ``FetchRequest.rehash`` set, so the daemon checks its bytes itself
    (``weightd.client.transports.resumable``): the error a caller sees is then the daemon's
    (:class:`ModelBroken`: the file changed), or this one again if the daemon's bytes
    were right and the second copy still arrived wrong. An adapter fetch raises it at
    once: the daemon digests every adapter slice as it sends it.
    """


#: The name this class had before reasons travelled.
DigestMismatchError = DigestMismatch


class ModelBroken(DataLossError):
    """A served file changed on the daemon's disk after verification; the daemon stops
    serving the model until it is reloaded (nothing unverified leaves)."""


class CheckpointInvalid(FailedPreconditionError):
    """The checkpoint on the daemon's disk is malformed, inconsistent or unsafe
    (``metadata["path"]`` names the file); it is never served."""


class ManifestRefused(FailedPreconditionError):
    """The trusted manifest is malformed or does not describe the checkpoint."""


class SignatureRefused(FailedPreconditionError):
    """The manifest's signature is missing, invalid or made by an untrusted key."""


class AdapterInvalid(FailedPreconditionError):
    """A LoRA adapter directory is malformed, unsafe or does not fit its base model."""


class LayoutRefused(InvalidArgumentError):
    """The model cannot be cut the way the request asks (a dimension that does not
    divide, a split through a quantization group)."""


class LayoutUnsupported(FailedPreconditionError):
    """The model has no sharding rules for a split (its architecture or quantization):
    only world size 1 is served."""


class InvalidRequest(InvalidArgumentError):
    """The request itself is malformed (a rank outside the world, a bad tensor name)."""


class LimitExceeded(ResourceExhaustedError):
    """A bound the daemon keeps was reached (streams, request size, adapter budget):
    back off and retry, or ask for less."""


class ObjectStoreFailed(UnavailableError):
    """The object store a model comes from failed (``metadata["uri"]`` names the
    object); retrying later can succeed."""


class TransportUnavailable(UnavailableError):
    """A same-host transport (shared memory, CUDA IPC) cannot serve a request that is
    itself fine; ``transport="auto"`` falls back to gRPC."""


class PackPendingError(TransportUnavailable):
    """The pack is being built and the request said not to wait (``no_wait``): the
    daemon serves the same tensors over gRPC now, from its verified shards."""


class AdapterLoadPending(UnavailableError):
    """The daemon is loading the adapter on request (another caller's load, or every load
    slot busy) and did not keep this caller waiting: the same request succeeds when
    asked again shortly (a :class:`~weightd.client.RetryPolicy` with
    ``reasons={"AdapterLoadPending"}`` does, and nothing else)."""


class StaleGrant(FailedPreconditionError):
    """A pack reference from an earlier daemon run, or one that no longer exists: fetch
    again."""


class VocabPadUnsupportedError(FailedPreconditionError):
    """A fetch asked for ``Layout.vocab_pad`` and the daemon predates it.

    Such a daemon ignores the field and cuts vocabulary-parallel tensors in equal
    blocks; the client refuses the stream rather than hand out other rows than asked
    for. Fetch with ``vocab_pad=0`` and re-cut, or upgrade the daemon.
    """


#: The daemon's error classes (``ErrorInfo.reason``) that have a situation class here.
#: A reason not listed arrives as a class of its own name under the first of its
#: ancestors (``error_lineage``) listed here with the same code, else under its code's
#: class: see :func:`class_for`.
REASONS: Final[dict[str, type[WeightdError]]] = {
    "ModelNotFound": ModelNotFound,
    "TensorNotFound": TensorNotFound,
    "AdapterNotFound": AdapterNotFound,
    "AdapterLoadPending": AdapterLoadPending,
    "ModelNotReady": NotServing,
    "DaemonUnreachable": DaemonUnreachable,
    "WorkerOnly": WorkerOnly,
    "AdminOnly": AdminOnly,
    "PermissionDenied": AccessDenied,
    "ModelChanged": ModelChanged,
    "DigestMismatchError": DigestMismatch,
    "DataIntegrityError": ModelBroken,
    "CheckpointError": CheckpointInvalid,
    "ManifestError": ManifestRefused,
    "SignatureError": SignatureRefused,
    "AdapterError": AdapterInvalid,
    "ShardingError": LayoutRefused,
    "NoShardingRules": LayoutUnsupported,
    "InvalidRequest": InvalidRequest,
    "ResourceLimitError": LimitExceeded,
    "ObjectStoreError": ObjectStoreFailed,
    "TransportError": TransportUnavailable,
    "PackPending": PackPendingError,
    "StaleGrant": StaleGrant,
    "InternalError": InternalError,
}

_BY_NAME: Final[dict[str, type[WeightdError]]] = {
    cls.code_name: cls
    for cls in (
        CancelledError,
        InvalidArgumentError,
        DeadlineExceededError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        ResourceExhaustedError,
        FailedPreconditionError,
        AbortedError,
        OutOfRangeError,
        UnimplementedError,
        InternalError,
        UnavailableError,
        DataLossError,
        UnauthenticatedError,
    )
}


def _name(code: int) -> str:
    """A status number's name (UNKNOWN for a number gRPC does not define)."""
    return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "UNKNOWN"


def _number(name: str) -> int:
    return STATUS_NAMES.index(name) if name in STATUS_NAMES else STATUS_NAMES.index("UNKNOWN")


#: What a reason must look like to become a class name: the daemon's are identifiers.
_REASON: Final = re.compile(r"[A-Z][A-Za-z0-9]{0,63}")
#: Classes made for reasons the table does not list, by (reason, base); bounded, as
#: reasons come from the peer.
_MADE: dict[tuple[str, type[WeightdError]], type[WeightdError]] = {}
_MADE_LIMIT: Final = 1024
_MADE_LOCK = threading.Lock()


def code_class(code: grpc.StatusCode | str) -> type[WeightdError]:
    """The class of a status code, or of its name (:class:`WeightdError` for OK and
    UNKNOWN)."""
    return _BY_NAME.get(code if isinstance(code, str) else code.name, WeightdError)


def class_for(code: grpc.StatusCode | str, reason: str, lineage: str = "") -> type[WeightdError]:
    """The class raised for a status with ``reason`` (and its ancestors, ``lineage``).

    Always a subclass of ``code``'s class: a listed situation whose code differs (a
    daemon class that changed code) is passed over for the next ancestor.
    """
    base = code_class(code)
    if not reason:
        return base
    for name in [reason, *lineage.split(",")]:
        cls = REASONS.get(name.strip())
        if cls is not None and issubclass(cls, base):
            if name == reason:
                return cls
            base = cls
            break
    if not _REASON.fullmatch(reason) or reason == base.__name__:
        return base
    with _MADE_LOCK:
        made = _MADE.get((reason, base))
        if made is None:
            if len(_MADE) >= _MADE_LIMIT:
                return base
            doc = f"The daemon's ``{reason}`` (see :class:`{base.__name__}`)."
            made = type(reason, (base,), {"__doc__": doc, "__module__": __name__})
            _MADE[(reason, base)] = made
        return made


def error_for(
    code: int,
    detail: str,
    *,
    transport: str | None = None,
    reason: str = "",
    metadata: Mapping[str, str] | None = None,
) -> WeightdError:
    """The typed error for a status number (as the side channel sends it)."""
    status = _name(code)
    fields = dict(metadata or {})
    cls = class_for(status, reason, fields.get(LINEAGE_KEY, ""))
    return cls(detail, status, transport=transport, reason=reason, metadata=fields)


def from_rpc_error(error: grpc.RpcError) -> WeightdError:
    """The typed error for a failed call (``error`` must be a ``grpc.Call``); a caller
    that knows the address says a peer that is no daemon plainly
    (:func:`.addresses.from_call`)."""
    code: grpc.StatusCode = error.code()
    detail: str = error.details() or ""
    reason, metadata = _error_info(error)
    return error_for(_number(code.name), detail, reason=reason, metadata=metadata)


def watch_failed(error: Exception) -> Exception | None:
    """What a watch stream's failure means: None where it was cancelled (``close()``
    ended it), the typed error for any other status, ``error`` itself where it is not
    gRPC's (``weightd.common.watch.EventStream``)."""
    import grpc  # loaded already: only a gRPC stream fails this way

    if not isinstance(error, grpc.RpcError):
        return error
    if error.code() is grpc.StatusCode.CANCELLED:
        return None
    return from_rpc_error(error)


def _error_info(error: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """The ErrorInfo of a failed call's rich status: (reason, metadata), or ("", {})."""
    trailers = getattr(error, "trailing_metadata", None)
    if not callable(trailers):
        return "", {}
    try:
        from google.protobuf.message import DecodeError
        from google.rpc import error_details_pb2, status_pb2
    except ImportError:  # googleapis-common-protos missing: map by code, as for old daemons
        return "", {}

    for key, value in trailers() or ():
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except DecodeError:
            return "", {}
        for item in status.details:
            info = error_details_pb2.ErrorInfo()
            if item.Is(info.DESCRIPTOR) and item.Unpack(info) and info.domain == DOMAIN:
                return info.reason, dict(list(info.metadata.items())[:MAX_FIELDS])
    return "", {}


def _rebuild(
    cls: type[WeightdError] | None,
    code: int,
    detail: str,
    transport: str | None,
    reason: str,
    metadata: dict[str, str],
) -> WeightdError:
    if cls is None:
        return error_for(code, detail, transport=transport, reason=reason, metadata=metadata)
    return cls(detail, _name(code), transport=transport, reason=reason, metadata=metadata)
