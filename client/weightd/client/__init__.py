"""The weightd client: ``WeightClient(target).fetch(rank, world_size)``.

Imports only grpcio, protobuf, googleapis-common-protos (the errors' detail, read
lazily) and torch (plus the standard library), so a worker needs none of the daemon's
dependencies. Every failure is a typed :class:`WeightdError` (``docs/guides/errors.md``);
every address follows one rule (``docs/guides/addresses.md``). torch loads with the
first call that makes tensors (and with the names below that need it), not with the
package: ``weightd list`` and ``describe`` take a fraction of a second instead of
torch's import time.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .api.client import WeightClient
from .base.errors import (
    AbortedError,
    AccessDenied,
    AdapterInvalid,
    AdapterLoadPending,
    AdapterNotFound,
    AdminOnly,
    CheckpointInvalid,
    DaemonUnreachable,
    DataLossError,
    DeadlineExceededError,
    DigestMismatch,
    DigestMismatchError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    InvalidRequest,
    LayoutRefused,
    LayoutUnsupported,
    LimitExceeded,
    ManifestRefused,
    MethodNotServed,
    ModelBroken,
    ModelChanged,
    ModelNotFound,
    NotFoundError,
    NotServing,
    NotWeightd,
    ObjectStoreFailed,
    PackPendingError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SignatureRefused,
    StaleGrant,
    TensorNotFound,
    TransportUnavailable,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
    VocabPadUnsupportedError,
    WeightdError,
    WorkerOnly,
)
from .base.layout import Layout
from .base.request import Delivery, DeliveryOptions, Transport, Wanted
from .transports.selection import FetchInfo, PackRef, TransportFailure

if TYPE_CHECKING:
    from .api.adapter_files import AdapterFiles, AdapterStatus
    from .api.adapters import AdapterEvent, AdapterWatch, AdapterWeights
    from .api.admin import AdminClient, Published, ReloadResult
    from .api.descriptions import FileDigest, ModelDescription, ModelInfo, TensorInfo
    from .api.tls import tls_credentials
    from .api.versions import VersionEvent, VersionHold, VersionInfo, VersionWatch
    from .base.retry import RetryPolicy, RetryStats
    from .transports.resumable import ResumeReport

#: Names loaded on first use (PEP 562): those whose modules import torch, and those a
#: worker's same-host fetch never needs (it imports only what it uses: a fresh
#: process's first fetch is timed in milliseconds, each module costs some).
_WITH_TORCH = {
    "AdapterEvent": ".api.adapters",
    "AdapterFiles": ".api.adapter_files",
    "AdapterStatus": ".api.adapter_files",
    "AdapterWatch": ".api.adapters",
    "AdapterWeights": ".api.adapters",
    "AdminClient": ".api.admin",
    "Published": ".api.admin",
    "ReloadResult": ".api.admin",
    "ResumeReport": ".transports.resumable",
    "FileDigest": ".api.descriptions",
    "ModelDescription": ".api.descriptions",
    "ModelInfo": ".api.descriptions",
    "TensorInfo": ".api.descriptions",
    "tls_credentials": ".api.tls",
    "RetryPolicy": ".base.retry",
    "RetryStats": ".base.retry",
    "VersionEvent": ".api.versions",
    "VersionHold": ".api.versions",
    "VersionInfo": ".api.versions",
    "VersionWatch": ".api.versions",
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
    "AccessDenied",
    "AdapterEvent",
    "AdapterFiles",
    "AdapterInvalid",
    "AdapterLoadPending",
    "AdapterNotFound",
    "AdapterStatus",
    "AdapterWatch",
    "AdapterWeights",
    "AdminClient",
    "AdminOnly",
    "CheckpointInvalid",
    "DaemonUnreachable",
    "DataLossError",
    "DeadlineExceededError",
    "Delivery",
    "DeliveryOptions",
    "DigestMismatch",
    "DigestMismatchError",
    "FailedPreconditionError",
    "FetchInfo",
    "FileDigest",
    "InternalError",
    "InvalidArgumentError",
    "InvalidRequest",
    "Layout",
    "LayoutRefused",
    "LayoutUnsupported",
    "LimitExceeded",
    "ManifestRefused",
    "MethodNotServed",
    "ModelBroken",
    "ModelChanged",
    "ModelDescription",
    "ModelInfo",
    "ModelNotFound",
    "NotFoundError",
    "NotServing",
    "NotWeightd",
    "ObjectStoreFailed",
    "PackPendingError",
    "PackRef",
    "PermissionDeniedError",
    "Published",
    "ReloadResult",
    "ResourceExhaustedError",
    "ResumeReport",
    "RetryPolicy",
    "RetryStats",
    "SignatureRefused",
    "StaleGrant",
    "TensorInfo",
    "TensorNotFound",
    "Transport",
    "TransportFailure",
    "TransportUnavailable",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "VersionEvent",
    "VersionHold",
    "VersionInfo",
    "VersionWatch",
    "VocabPadUnsupportedError",
    "Wanted",
    "WeightClient",
    "WeightdError",
    "WorkerOnly",
    "tls_credentials",
]
