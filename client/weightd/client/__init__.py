"""The weightd client: ``WeightClient(target).fetch(rank, world_size)``.

Imports only grpcio, protobuf and torch (plus the standard library), so a worker
needs none of the daemon's dependencies.
"""

from .admin import AdminClient, ReloadResult
from .client import WeightClient
from .descriptions import FileDigest, ModelDescription, ModelInfo, TensorInfo
from .errors import (
    AbortedError,
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
from .layout import Layout
from .resumable import ResumeReport
from .retry import RetryPolicy, RetryStats
from .tls import tls_credentials
from .transports import FetchInfo, PackRef, TransportFailure

__all__ = [
    "AbortedError",
    "AdminClient",
    "DataLossError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FetchInfo",
    "FileDigest",
    "InvalidArgumentError",
    "Layout",
    "ModelDescription",
    "ModelInfo",
    "NotFoundError",
    "PackRef",
    "PermissionDeniedError",
    "ReloadResult",
    "ResourceExhaustedError",
    "ResumeReport",
    "RetryPolicy",
    "RetryStats",
    "TensorInfo",
    "TransportFailure",
    "UnauthenticatedError",
    "UnavailableError",
    "WeightClient",
    "WeightdError",
    "tls_credentials",
]
