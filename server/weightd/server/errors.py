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


# --- same-host transports (shared-memory packs, pinned staging, CUDA IPC) ---------


class TransportError(WeightdError):
    """A same-host transport cannot serve a request that is itself fine.

    The side channel marks these (``LocalError.transport``) so a client on
    ``transport="auto"`` reports the failure and falls back to gRPC, which may well
    succeed; every other error means the request is wrong and gRPC would refuse it too.
    """

    code = grpc.StatusCode.UNAVAILABLE


class PackMemoryExhausted(TransportError):
    """A pack does not fit: its budget is held by leased packs, or the kernel refused memory."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PlacementUnavailable(TransportError):
    """The daemon does not offer the placement asked for (CUDA IPC off, GPU not visible)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class CudaFailure(TransportError):
    """A CUDA driver call failed while placing or pinning a pack."""


class StaleGrant(WeightdError):
    """A pack reference from an earlier daemon boot, or a pack that no longer exists."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class LocalProtocolError(WeightdError):
    """A side-channel request that is malformed or out of order."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class CudaUnavailable(WeightdError):
    """A start-up option needs CUDA (``--pin``, ``--cuda-ipc``) and this host has none."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a failed RPC answers with. The only place codes are chosen."""
    if isinstance(error, WeightdError):
        return error.code, error.message
    return grpc.StatusCode.INTERNAL, f"internal error ({type(error).__name__}); see the daemon log"
