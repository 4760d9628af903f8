"""One error hierarchy for the daemon, and the one table that maps it to gRPC.

Every failure the daemon can explain is a :class:`WeightdError` subclass whose
message names the model, file, tensor or field at fault. The service layer turns
these into a status with :func:`status_for` and nothing else; anything that is not a
``WeightdError`` is a bug and becomes INTERNAL (logged with its traceback), so an
explained failure can never be reported under the wrong code.
"""

from __future__ import annotations

import grpc


class WeightdError(Exception):
    """Base of every error the daemon explains to its callers."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


# --- reading and verifying checkpoints -------------------------------------------


class CheckpointError(WeightdError):
    """A checkpoint on disk is malformed, inconsistent or unsafe to open.

    Raised while loading; the model is never published. On a reload the old
    version keeps serving and the RPC answers FAILED_PRECONDITION.
    """

    code = grpc.StatusCode.FAILED_PRECONDITION

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


# --- serving ----------------------------------------------------------------------


class ModelNotFound(WeightdError):
    code = grpc.StatusCode.NOT_FOUND


class TensorNotFound(WeightdError):
    code = grpc.StatusCode.NOT_FOUND


class InvalidRequest(WeightdError):
    """The request itself is malformed (a rank outside the world, a zero world size)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ShardingError(WeightdError):
    """The model cannot be split the way the request asks (a dimension not divisible)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NoShardingRules(WeightdError):
    """The model's architecture has no sharding rules, so only world_size 1 is served."""

    code = grpc.StatusCode.FAILED_PRECONDITION


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

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class ModelNotReady(WeightdError):
    """The model is still being verified, or is draining; retrying later can succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class DataIntegrityError(WeightdError):
    """Bytes on disk no longer match what was verified (file truncated or rewritten).

    The daemon stops serving the model until it is reloaded; nothing unverified leaves.
    """

    code = grpc.StatusCode.DATA_LOSS


class ResourceLimitError(WeightdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestTooLarge(ResourceLimitError):
    """A request field exceeds its bound (too many tensor names, a name too long)."""


class StreamTimeLimit(WeightdError):
    """A stream ran past the daemon's own cap on stream duration (``--max-stream-seconds``)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


# --- access -------------------------------------------------------------------------


class Unauthenticated(WeightdError):
    """The caller presented no identity where one is required (admin over TCP without a
    client certificate the daemon can read)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(WeightdError):
    """The caller is known but not allowed: an admin RPC on the worker listener, or a
    client certificate whose identity is not in ``--admin-allow``."""

    code = grpc.StatusCode.PERMISSION_DENIED


# --- start-up -----------------------------------------------------------------------


class SecurityConfigError(WeightdError):
    """The daemon was told to listen in a way its security defaults refuse (TCP without
    TLS and without ``--insecure``, admin over TCP without mutual TLS, unreadable
    certificate files). Raised at start-up; the daemon exits with one line."""


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a failed RPC answers with. The only place codes are chosen."""
    if isinstance(error, WeightdError):
        return error.code, error.message
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__}); see the daemon log"
