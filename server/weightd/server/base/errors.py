"""One error hierarchy for the daemon, and the one table that maps it to a status.

Every failure the daemon can explain is a :class:`WeightdError` subclass whose
message names the model, file, tensor or field at fault, and whose class says its
:class:`Code`. Every edge turns failures into a status with :func:`status_for` and
nothing else (the gRPC servicers through :mod:`weightd.server.rpc.status`, the side
channel directly); anything that is not a ``WeightdError`` is a bug and becomes
INTERNAL (logged with its traceback), so an explained failure can never be reported
under the wrong code.

Why a code enum of our own rather than ``grpc.StatusCode``: every stage imports this
module, and the pure ones (parsing, planning) must not depend on the RPC library.
The numbers are gRPC's, so the side channel sends them as they are and the gRPC edge
converts by name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from .redact import redact


class Code(enum.IntEnum):
    """The status codes the daemon answers with; numbers and names as in gRPC."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class WeightdError(Exception):
    """Base of every error the daemon explains to its callers.

    Its class name and :attr:`fields` travel with the status (``google.rpc.ErrorInfo``
    over gRPC, ``LocalError.reason``/``metadata`` on the side channel; see
    :func:`error_status`), so a client acts on the situation, never on the text.
    A field is any public attribute set on the instance besides ``message``: a
    subclass that stores ``self.path`` sends ``path``; a raise site passes more as
    keywords (``ModelNotFound(message, model=name)``).
    """

    code: Code = Code.INTERNAL

    def __init__(self, message: str, **fields: str | int | float | bool) -> None:
        super().__init__(message)
        self.message = message
        for key, value in fields.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return self.message

    @property
    def fields(self) -> dict[str, str | int | float | bool]:
        """The error's fields by name (path, tensor, model, uri, ...), scalars only."""
        return {
            key: value
            for key, value in vars(self).items()
            if key != "message"
            and not key.startswith("_")
            and isinstance(value, str | int | float | bool)
        }


# --- reading and verifying checkpoints -------------------------------------------


class CheckpointError(WeightdError):
    """A checkpoint on disk is malformed, inconsistent or unsafe to open.

    Raised while loading; the model is never published. On a reload the old
    version keeps serving and the RPC answers FAILED_PRECONDITION.
    """

    code = Code.FAILED_PRECONDITION

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class HeaderError(CheckpointError):
    """A safetensors header violates the format (or weightd's stricter reading of it)."""


class IndexFileError(CheckpointError):
    """``model.safetensors.index.json`` is malformed or disagrees with the shards."""


class ConfigError(CheckpointError):
    """``config.json`` is missing, malformed or lacks a field the rules need."""


class UnsafePathError(CheckpointError):
    """A file name would leave the model directory or names a non-regular file."""


# Each rule family below has its own type, so a caller (and a test) can tell exactly
# which rule a file broke; all of them are CheckpointErrors (never published).


class HeaderLengthError(HeaderError):
    """The 8-byte length prefix: file too short, length over the cap or past the file."""


class HeaderEncodingError(HeaderError):
    """The header bytes are not UTF-8."""


class HeaderSyntaxError(HeaderError):
    """The header is not JSON, or not a JSON object."""


class NonFiniteNumberError(HeaderError):
    """``NaN`` / ``Infinity`` in a header: Python's json accepts them, JSON does not."""


class DuplicateKeyError(HeaderError):
    """A tensor, ``__metadata__`` or field key appears twice (the reference keeps the last)."""


class TensorNameError(HeaderError):
    """A tensor name is empty, over-long or contains control characters."""


class TensorEntryError(HeaderError):
    """A tensor entry is not an object, or lacks or adds a field."""


class DtypeError(HeaderError):
    """A dtype safetensors does not define."""


class ShapeError(HeaderError):
    """A shape that is not a list of non-negative integers, or whose size overflows."""


class OffsetsError(HeaderError):
    """``data_offsets`` malformed, reversed, or leaving gaps, overlaps or shared ranges."""


class ByteSizeError(HeaderError):
    """A tensor's byte range disagrees with its shape times its dtype's size."""


class AlignmentError(HeaderError):
    """A tensor's offset is not a multiple of its element size (policy: rejected)."""


class DataSectionError(HeaderError):
    """The data section is truncated, or has trailing bytes after the last tensor."""


class MetadataError(HeaderError):
    """``__metadata__`` is not an object of strings."""


class IndexSyntaxError(IndexFileError):
    """The index is not strict JSON (not UTF-8, duplicate keys, NaN) or not an object."""


class IndexSchemaError(IndexFileError):
    """The index lacks ``weight_map`` or has a field of the wrong type."""


class ShardAssignmentError(IndexFileError):
    """A tensor is not in the shard the index names, or is in a shard but not the index."""


class DuplicateTensorError(IndexFileError):
    """A tensor name is stored in two shards."""


class TotalSizeError(IndexFileError):
    """``metadata.total_size`` differs from the bytes the tensors hold."""


class ShardFormatError(IndexFileError):
    """A shard that is not ``.safetensors`` (pickle formats are code; never opened)."""


class PathEscapeError(UnsafePathError):
    """A name or link that would leave the model directory (absolute, ``..``, drive, ...)."""


class OutsideRootError(PathEscapeError):
    """A directory a caller named that is outside the configured roots (``--adapter-root``),
    or whose links lead out of them: the caller may not have it read."""

    code = Code.PERMISSION_DENIED


class NotRegularFileError(UnsafePathError):
    """A FIFO, device, socket or directory where a regular file is expected."""


class MissingFileError(CheckpointError):
    """A file the checkpoint needs does not exist."""


class ConfigSyntaxError(ConfigError):
    """``config.json`` is not strict JSON or not an object."""


class ConfigFieldError(ConfigError):
    """A ``config.json`` field the layout needs is missing or has an impossible value."""


class LayoutError(CheckpointError):
    """The tensors disagree with the parameters ``config.json`` implies."""


class MissingTensorError(LayoutError):
    """A parameter the config implies is in no shard."""


class UnexpectedTensorError(LayoutError):
    """A tensor the config does not account for."""


class TensorShapeError(LayoutError):
    """A tensor's shape differs from the config's (transposed or otherwise)."""


class TensorDtypeError(LayoutError):
    """A tensor's dtype differs from the config's ``torch_dtype`` / ``dtype``."""


class ManifestError(CheckpointError):
    """A trusted manifest is malformed or does not describe the checkpoint."""


class ManifestSyntaxError(ManifestError):
    """The manifest is not strict JSON or not an object."""


class ManifestSchemaError(ManifestError):
    """The manifest lacks a field, has one of the wrong type, or an unknown version."""


class ManifestMismatchError(ManifestError):
    """The checkpoint has files or tensors the manifest lacks, or the reverse, or another
    dtype, shape or shard for a tensor."""


class DigestMismatchError(CheckpointError):
    """Bytes on disk do not hash to the trusted digest or size (a manifest's, or a Hugging
    Face cache blob's name). Nothing is served."""

    code = Code.DATA_LOSS


class SignatureError(CheckpointError):
    """A manifest signature is missing, invalid or made by a key that is not trusted."""


class KeyFileError(SignatureError):
    """A key file is unreadable or not an Ed25519 key of the expected kind."""


class UnsignedManifestError(SignatureError):
    """A trust key was given but the manifest carries no signature."""


class UntrustedKeyError(SignatureError):
    """The manifest is signed, but by a key not among the trusted ones."""


class BadSignatureError(SignatureError):
    """The signature does not verify: the manifest was changed after signing."""


class SignatureSyntaxError(SignatureError):
    """An OMS signature file is not a readable Sigstore bundle (truncated, garbled, too
    large): untrusted input, refused in one line."""


class UnsupportedSignatureError(SignatureError):
    """An OMS signature weightd cannot check: the ``sigstore`` method (needs the
    network) or a serialization other than ``files`` with SHA-256."""


class HFCacheError(CheckpointError):
    """A directory used as a Hugging Face cache snapshot is not laid out as one."""


class NotASnapshotError(HFCacheError):
    """The model directory is not ``.../models--ORG--NAME/snapshots/REVISION``."""


class BlobLinkError(HFCacheError):
    """A file in the snapshot is not a link to a content-named blob of that repository."""


# --- LoRA adapters ------------------------------------------------------------------


class AdapterError(CheckpointError):
    """A PEFT LoRA adapter directory is malformed, unsafe or does not fit the base model.

    Raised while loading an adapter; it is never published, and the adapters already
    loaded (including an older version under the same name) keep serving.
    """


class AdapterConfigError(AdapterError):
    """``adapter_config.json`` is not strict JSON, or lacks a field, or has an impossible value."""


class UnsupportedAdapterFeature(AdapterError):
    """A PEFT feature weightd does not serve (DoRA, ``modules_to_save``, trained biases, ...)."""


class AdapterFormatError(AdapterError):
    """The adapter's weights are not ``adapter_model.safetensors`` (pickle is never opened)."""


class AdapterTensorError(AdapterError):
    """A tensor name that is not a LoRA A/B weight, or a module with only one of A and B."""


class AdapterTargetError(AdapterError):
    """A LoRA module that is not among ``target_modules`` or not a 2-D weight of the base."""


class AdapterShapeError(AdapterError):
    """A LoRA tensor whose shape disagrees with the base layer or with ``r``."""


class AdapterDtypeError(AdapterError):
    """A LoRA tensor of a dtype weightd does not serve for adapters."""


class AdapterBaseMismatch(AdapterError):
    """``base_model_name_or_path`` names another model than the one the adapter is loaded on."""


# --- serving ----------------------------------------------------------------------


class ModelNotFound(WeightdError):
    code = Code.NOT_FOUND


class TensorNotFound(WeightdError):
    code = Code.NOT_FOUND


class VersionNotHeld(ModelNotFound):
    """A model version the daemon no longer holds (replaced and let go, or never
    published): an engine must move to a version the daemon still has."""


class InvalidRequest(WeightdError):
    """The request itself is malformed (a rank outside the world, a zero world size)."""

    code = Code.INVALID_ARGUMENT


class RequestPathError(InvalidRequest):
    """A path in a request that is no plain path (a NUL byte, a ``..`` component): the
    caller's mistake, refused before anything is opened."""


class PublishRefused(InvalidRequest):
    """A trainer's in-memory publish that the daemon refuses before anything is built:
    its tensors do not match the serving version (``tensor``, ``got``, ``expected``
    name which and how), or its hand-over breaks a rule (an unsealed or oversized
    region, a descriptor too many)."""


class PublishAborted(WeightdError):
    """The trainer went away (its connection closed, its stream broke) before the
    version was committed: nothing was published."""

    code = Code.CANCELLED


class MemoryPublishUntrusted(WeightdError):
    """A trainer's in-memory publish where the operator requires every version to be
    proved by a manifest, a signature or the Hugging Face cache (memory carries none)."""

    code = Code.FAILED_PRECONDITION


class NoSourceToReload(WeightdError):
    """A reload of a model whose serving version came from a trainer's memory: there
    are no files to re-read, and reverting to older weights silently would be wrong."""

    code = Code.FAILED_PRECONDITION


class ShardingError(WeightdError):
    """The model cannot be split the way the request asks (a dimension not divisible)."""

    code = Code.INVALID_ARGUMENT


class NoShardingRules(WeightdError):
    """The model's architecture has no sharding rules, so only world_size 1 is served."""

    code = Code.FAILED_PRECONDITION


class QuantizationSplitError(ShardingError):
    """A split would cut a quantization group, a packed word or a scale block."""


class TensorNotInLayout(InvalidRequest):
    """A tensor asked for by name belongs to another pipeline stage or expert rank."""


class UnsupportedQuantization(NoShardingRules):
    """The checkpoint's quantization method has no slicing rules; only whole tensors."""


class RulesFileError(WeightdError):
    """A sharding rules table (a ``--rules`` file or a built-in one) is malformed.

    Raised at start-up (``weightd serve``/``plan``), before any model is loaded.
    """

    code = Code.FAILED_PRECONDITION

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class UnmatchableName(WeightdError):
    """A name a file's pattern cannot be matched against the way Python's ``re`` would.

    Only a non-ASCII name against a pattern whose classes RE2 reads as ASCII (see
    :mod:`weightd.server.base.patterns`): refused rather than answered differently.
    """

    code = Code.FAILED_PRECONDITION


class ModelNotReady(WeightdError):
    """The model is still being verified, or is draining; retrying later can succeed."""

    code = Code.UNAVAILABLE


class ModelLoadFailed(WeightdError):
    """The model could not be loaded (its source failed or did not verify); the other
    models serve. A reload retries it."""

    code = Code.FAILED_PRECONDITION


class ReloadTimedOut(WeightdError):
    """A reload did not finish (or could not start, another reload of the model holding
    it) within the caller's deadline; the version serving before keeps serving."""

    code = Code.DEADLINE_EXCEEDED


class ModelChanged(WeightdError):
    """A resumed fetch names content the daemon no longer serves (reloaded or restarted
    on another checkpoint): the client must start again from the first tensor rather
    than mix two versions in one rank."""

    code = Code.ABORTED


class DataIntegrityError(WeightdError):
    """Bytes on disk no longer match what was verified (file truncated or rewritten).

    The daemon stops serving the model until it is reloaded; nothing unverified leaves.
    """

    code = Code.DATA_LOSS


# --- remote sources (object storage) ----------------------------------------------


class ObjectStoreError(WeightdError):
    """The object store a model or adapter comes from failed us; the message names the
    ``s3://`` object and never a credential. Retrying later can succeed unless a
    subclass says otherwise."""

    code = Code.UNAVAILABLE

    def __init__(self, uri: str, problem: str) -> None:
        super().__init__(f"{uri}: {problem}")
        self.uri = uri
        self.problem = problem


class ObjectStoreUnreachable(ObjectStoreError):
    """The endpoint refused the connection, timed out or does not resolve."""


class ObjectStoreTooSlow(ObjectStoreUnreachable):
    """An answer passed its time bound, or a ranged GET fell below the minimum rate after
    its grace window (``--s3-min-bytes-per-second``): the connection was closed."""


class ObjectStoreProtocolError(ObjectStoreError):
    """The store answered outside what S3 allows or outside weightd's bounds: a listing
    entry without a key, a size that is not a non-negative integer, a ranged GET without
    the ETag or ``Content-Range`` that proves which version it came from, a listing over
    its bounds. Nothing from that answer is used."""

    code = Code.FAILED_PRECONDITION


class SourceCancelled(ObjectStoreError):
    """A download was cancelled: its reload's deadline passed, or the daemon is stopping."""

    code = Code.CANCELLED


class ObjectStoreThrottled(ObjectStoreError):
    """The store kept answering SlowDown / 503 after the SDK's retries with backoff."""


class ObjectNotFound(ObjectStoreError):
    """A bucket, prefix or object that the configuration names does not exist."""

    code = Code.FAILED_PRECONDITION


class ObjectAccessDenied(ObjectStoreError):
    """The store refused our credentials (unknown key, bad signature, no permission)."""

    code = Code.FAILED_PRECONDITION


class ObjectChanged(ObjectStoreError):
    """An object no longer has the ETag / version pinned when its download began; the
    download stops rather than mix two versions in one file. Retrying fetches the new
    version whole."""

    code = Code.ABORTED


class ObjectTruncated(ObjectStoreError):
    """The store sent fewer (or more) bytes than the range or the object's size says."""

    code = Code.DATA_LOSS


class ObjectTooLarge(ObjectStoreError):
    """An object is larger than weightd accepts for what it is (a JSON file of a model
    directory without a manifest pinning its size): never downloaded."""

    code = Code.FAILED_PRECONDITION


class RemoteTrustError(WeightdError):
    """A remote source was named without a trust root: an object store is not one, so a
    manifest (or an explicit ``--trust-object-store``) is required."""

    code = Code.FAILED_PRECONDITION


class ResourceLimitError(WeightdError):
    code = Code.RESOURCE_EXHAUSTED


class AdapterNotFound(WeightdError):
    """No adapter of that name is loaded (never was, unloaded, or evicted)."""

    code = Code.NOT_FOUND


class NoAdapters(WeightdError):
    """The daemon was started without adapter serving."""

    code = Code.FAILED_PRECONDITION


class AdapterLoadPending(WeightdError):
    """A load on request is in progress (another caller's, or too many at once): this
    caller is not kept waiting on a server thread; it asks again."""

    code = Code.UNAVAILABLE


class AdapterTrustError(WeightdError):
    """A worker asked for an adapter the operator allows to be loaded on request, but
    nothing vouches for its bytes: no pinned ``--adapter-digest`` for it, and the operator
    did not declare the adapter roots a trust root (``--adapter-autoload-trust-roots``)."""

    code = Code.FAILED_PRECONDITION


class AdapterBudgetExhausted(ResourceLimitError):
    """An adapter does not fit the adapter budget even after evicting every adapter that
    is neither leased nor pinned; nothing was evicted."""


class WatchOverflow(ResourceLimitError):
    """A watcher read adapter or version events too slowly and missed some; it must
    watch again."""


class RequestTooLarge(ResourceLimitError):
    """A request field exceeds its bound (too many tensor names, a name too long)."""


class StreamTimeLimit(WeightdError):
    """A stream ran past the daemon's own cap on stream duration (``--max-stream-seconds``)."""

    code = Code.DEADLINE_EXCEEDED


# --- files weightd writes ------------------------------------------------------------


class OutputWriteError(WeightdError):
    """A file weightd writes (a manifest, a key, the hash cache) could not be written whole.

    Writes go to a temporary file beside the target, are fsynced and renamed into place,
    so the previous file (if any) is untouched and nothing half-written is left behind.
    """

    code = Code.FAILED_PRECONDITION

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"cannot write {path}: {problem}")
        self.path = path
        self.problem = problem


class StorageFullError(OutputWriteError):
    """The file system is full, a quota or a file-size limit was hit (ENOSPC, EDQUOT, EFBIG)."""

    code = Code.RESOURCE_EXHAUSTED


# --- access -------------------------------------------------------------------------


class Unauthenticated(WeightdError):
    """The caller presented no identity where one is required (admin over TCP without a
    client certificate the daemon can read)."""

    code = Code.UNAUTHENTICATED


class PermissionDenied(WeightdError):
    """The caller is known but not allowed: an admin RPC on the worker listener, or a
    client certificate whose identity is not in ``--admin-allow``."""

    code = Code.PERMISSION_DENIED


# --- start-up -----------------------------------------------------------------------


class SecurityConfigError(WeightdError):
    """The daemon was told to listen in a way its security defaults refuse (TCP without
    TLS and without ``--insecure``, admin over TCP without mutual TLS, unreadable
    certificate files). Raised at start-up; the daemon exits with one line."""


# --- same-host transports (shared-memory packs, pinned staging, CUDA IPC) ---------


class TransportError(WeightdError):
    """A same-host transport cannot serve a request that is itself fine.

    The side channel marks these (``LocalError.transport``) so a client on
    ``transport="auto"`` reports the failure and falls back to gRPC, which may well
    succeed; every other error means the request is wrong and gRPC would refuse it too.
    """

    code = Code.UNAVAILABLE


class PackMemoryExhausted(TransportError):
    """A pack does not fit: its budget is held by leased packs, or the kernel refused memory."""

    code = Code.RESOURCE_EXHAUSTED


class PackPending(TransportError):
    """The pack asked for is being built and the asker does not wait: gRPC serves it now."""

    code = Code.UNAVAILABLE


class PlacementUnavailable(TransportError):
    """The daemon does not offer the placement asked for (CUDA IPC off, GPU not visible)."""

    code = Code.FAILED_PRECONDITION


class SideChannelFull(TransportError):
    """Every side-channel connection slot is taken; the client may fall back to gRPC."""

    code = Code.RESOURCE_EXHAUSTED


class CudaFailure(TransportError):
    """A CUDA driver call failed while placing or pinning a pack."""


class StaleGrant(WeightdError):
    """A pack reference from an earlier daemon boot, or a pack that no longer exists."""

    code = Code.FAILED_PRECONDITION


class LocalProtocolError(WeightdError):
    """A side-channel request that is malformed or out of order."""

    code = Code.INVALID_ARGUMENT


class CudaUnavailable(WeightdError):
    """A start-up option needs CUDA (``--pin``, ``--cuda-ipc``) and this host has none."""

    code = Code.FAILED_PRECONDITION


class ListenError(WeightdError):
    """The daemon cannot listen where it was asked to."""

    code = Code.FAILED_PRECONDITION


class UsageError(WeightdError):
    """Options that contradict each other (reported as one line, exit 1)."""

    code = Code.INVALID_ARGUMENT


class ConfigFileError(UsageError):
    """The ``--config`` file cannot be read, is not TOML, or holds an unknown key or a
    value of the wrong type (the message names the file and the key)."""


class DaemonUnreachable(WeightdError):
    """A client command found no daemon at its target: no socket there, nothing listening,
    a name that does not resolve. Said as such (with what to check), not as gRPC's raw
    ``connect failed``, so the user knows the daemon was never asked."""

    code = Code.UNAVAILABLE


class AdminOnly(PermissionDenied):
    """An admin RPC sent to the worker listener; the message names the admin listener."""


class WorkerOnly(WeightdError):
    """A worker RPC (fetch, list, describe) sent to the admin listener; the message names
    the worker listener. UNIMPLEMENTED, as a server without the method would answer."""

    code = Code.UNIMPLEMENTED


#: ``google.rpc.ErrorInfo.domain`` of every status the daemon sends.
ERROR_DOMAIN: Final = "weightd.dev"
#: The reason of a failure that is not a :class:`WeightdError` (a bug; logged).
INTERNAL_REASON: Final = "InternalError"
#: Metadata key listing the error's ancestors, nearest first (``HeaderError,CheckpointError``):
#: a client that does not know a newer daemon's class still finds its family.
LINEAGE_KEY: Final = "error_lineage"
#: Bounds on what a status carries: gRPC clients refuse trailers over 8 KiB in all, and
#: the detail travels twice (``grpc-message`` and the rich status, base64-encoded).
MAX_DETAIL_BYTES: Final = 1536
MAX_FIELD_CHARS: Final = 200
MAX_FIELDS: Final = 12


@dataclass(frozen=True)
class ErrorStatus:
    """What a failure answers with, on every edge: code, detail, reason and fields."""

    code: Code
    detail: str
    reason: str
    metadata: dict[str, str]


def status_for(error: BaseException) -> tuple[Code, str]:
    """The status a failure answers with. The only place codes are chosen."""
    status = error_status(error)
    return status.code, status.detail


def error_status(error: BaseException) -> ErrorStatus:
    """``error`` as a status (pure): its code from the class, its detail bounded, its
    class name as the reason and its fields (escaped, capped) as the metadata."""
    if not isinstance(error, WeightdError):
        detail = f"internal error ({type(error).__name__}); see the daemon log"
        return ErrorStatus(Code.INTERNAL, detail, INTERNAL_REASON, {})
    metadata: dict[str, str] = {}
    for key, value in list(error.fields.items())[:MAX_FIELDS]:
        metadata[key] = _field_text(value)
    lineage = [
        c.__name__
        for c in type(error).__mro__[1:]
        if issubclass(c, WeightdError) and c is not WeightdError
    ]
    if lineage:
        metadata[LINEAGE_KEY] = ",".join(lineage)
    return ErrorStatus(error.code, _bounded(error.message), type(error).__name__, metadata)


def _field_text(value: str | int | float | bool) -> str:
    """A field as metadata text: control characters escaped, cut to its bound."""
    text = redact(_escaped(value if isinstance(value, str) else str(value)))
    return text if len(text) <= MAX_FIELD_CHARS else text[:MAX_FIELD_CHARS] + "..."


def _escaped(text: str) -> str:
    """``text`` with every character that is not printable (ESC, CR, LF, a bidi
    override) written as its escape; printable text, a space included, is kept."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _bounded(detail: str) -> str:
    """``detail`` as it leaves the daemon: control characters escaped, credentials in URLs
    masked (:func:`~.redact.redact`), cut to :data:`MAX_DETAIL_BYTES` of UTF-8 saying
    how much was cut. The one place every error detail is made, on every edge (gRPC,
    the side socket), so a string from outside that a message quotes unescaped (a
    path, a manifest name, a GPU id) still cannot forge a line or move a terminal's
    cursor, and a configured secret a message names is not echoed."""
    detail = redact(_escaped(detail))
    raw = detail.encode()
    if len(raw) <= MAX_DETAIL_BYTES:
        return detail
    kept = raw[: MAX_DETAIL_BYTES - 64].decode(errors="ignore")
    return f"{kept}... ({len(raw)} bytes in all; cut)"


#: Characters of a client-supplied string quoted back in an error detail.
ECHO_CHARS: Final = 80


_PLAIN: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@")


def echo(value: object, *, bare: bool = False) -> str:
    """A string from outside (a client's field, an object store's error code, message,
    key or header) as it may appear in an error detail, a log line or a metric label:
    escaped (``repr``: no newline, control or bidi character survives, so it can never
    forge a line or hide text) and cut to :data:`ECHO_CHARS` characters.

    ``bare``: a plain token (letters, digits, ``-_.:/@``) within the cap is shown
    unquoted, as an error code reads best. The one helper for every such string.
    """
    text = value if isinstance(value, str) else str(value)
    if bare and text and len(text) <= ECHO_CHARS and all(c in _PLAIN for c in text):
        return text
    if len(text) <= ECHO_CHARS:
        return repr(text)
    return f"{text[:ECHO_CHARS]!r}... ({len(text.encode(errors='replace'))} bytes)"
