"""The weightd client: ``WeightClient(target).fetch(rank, world_size)``.

Imports only grpcio, protobuf and torch (plus the standard library), so a worker
needs none of the daemon's dependencies. torch loads with the first call that makes
tensors (and with the names below that need it), not with the package: ``weightd
list`` and ``describe`` take a fraction of a second instead of torch's import time.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .client import WeightClient
from .descriptions import FileDigest, ModelDescription, ModelInfo, TensorInfo
from .errors import (
    AbortedError,
    DataLossError,
    DeadlineExceededError,
    DigestMismatchError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    VocabPadUnsupportedError,
    WeightdError,
)
from .layout import Layout
from .retry import RetryPolicy, RetryStats
from .tls import tls_credentials
from .transports import FetchInfo, PackRef, TransportFailure
from .versions import VersionEvent, VersionHold, VersionInfo, VersionWatch

if TYPE_CHECKING:
    from .admin import AdminClient, Published, ReloadResult
    from .resumable import ResumeReport

#: Names whose modules import torch, loaded on first use (PEP 562).
_WITH_TORCH = {
    "AdminClient": ".admin",
    "Published": ".admin",
    "ReloadResult": ".admin",
    "ResumeReport": ".resumable",
}


def __getattr__(name: str) -> Any:
    module = _WITH_TORCH.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AbortedError",
    "AdminClient",
    "DataLossError",
    "DeadlineExceededError",
    "DigestMismatchError",
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
    "Published",
    "ReloadResult",
    "ResourceExhaustedError",
    "ResumeReport",
    "RetryPolicy",
    "RetryStats",
    "TensorInfo",
    "TransportFailure",
    "UnauthenticatedError",
    "UnavailableError",
    "VersionEvent",
    "VersionHold",
    "VersionInfo",
    "VersionWatch",
    "VocabPadUnsupportedError",
    "WeightClient",
    "WeightdError",
    "tls_credentials",
]
