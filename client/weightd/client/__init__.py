"""The weightd client: ``WeightClient(target).fetch(rank, world_size)``.

Imports only grpcio, protobuf and torch (plus the standard library), so a worker
needs none of the daemon's dependencies.
"""

from .client import ModelDescription, ModelInfo, TensorInfo, WeightClient
from .errors import (
    DataLossError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    WeightdError,
)
from .transports import FetchInfo, PackRef, TransportFailure

__all__ = [
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FetchInfo",
    "InvalidArgumentError",
    "ModelDescription",
    "ModelInfo",
    "NotFoundError",
    "PackRef",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "TensorInfo",
    "TransportFailure",
    "UnauthenticatedError",
    "UnavailableError",
    "WeightClient",
    "WeightdError",
]
