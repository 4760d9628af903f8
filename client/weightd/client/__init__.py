"""The weightd client: ``WeightClient(target).fetch(rank, world_size)``.

Imports only grpcio, protobuf and torch (plus the standard library), so a worker
needs none of the daemon's dependencies. torch loads with the first call that makes
tensors (and with the names below that need it), not with the package: ``weightd
list`` and ``describe`` take a fraction of a second instead of torch's import time.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .client import WeightClient
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
from .transports import FetchInfo, PackRef, TransportFailure

if TYPE_CHECKING:
    from .admin import AdminClient, ReloadResult
    from .descriptions import FileDigest, ModelDescription, ModelInfo, TensorInfo
    from .resumable import ResumeReport
    from .retry import RetryPolicy, RetryStats
    from .tls import tls_credentials

#: Names loaded on first use (PEP 562): those whose modules import torch, and those a
#: worker's same-host fetch never needs (it imports only what it uses: a fresh
#: process's first fetch is timed in milliseconds, each module costs some).
_WITH_TORCH = {
    "AdminClient": ".admin",
    "ReloadResult": ".admin",
    "ResumeReport": ".resumable",
    "FileDigest": ".descriptions",
    "ModelDescription": ".descriptions",
    "ModelInfo": ".descriptions",
    "TensorInfo": ".descriptions",
    "tls_credentials": ".tls",
    "RetryPolicy": ".retry",
    "RetryStats": ".retry",
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
    "ReloadResult",
    "ResourceExhaustedError",
    "ResumeReport",
    "RetryPolicy",
    "RetryStats",
    "TensorInfo",
    "TransportFailure",
    "UnauthenticatedError",
    "UnavailableError",
    "VocabPadUnsupportedError",
    "WeightClient",
    "WeightdError",
    "tls_credentials",
]
