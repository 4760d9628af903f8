"""An adapter's status, and one version's two files as the daemon verified them.

For engines that read PEFT's own files (vLLM loads a LoRA adapter from a directory):
the daemon sends ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as it
read and verified them, and :func:`fetch_adapter_files` checks here that their SHA-256s
give the version's digest (the one an operator can pin), so what an engine writes out
and loads is byte for byte what the daemon verified. torch-free: the CLI and vLLM's
API server process use it without making tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import grpc

from weightd.common.digests import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_digest
from weightd.v1 import weightd_pb2 as pb

from .errors import DataLossError, ResourceExhaustedError, from_rpc_error

#: Largest adapter (both files) a client accepts unless told otherwise: the daemon's
#: own limit for the weights file plus its config limit.
MAX_ADAPTER_FILES_BYTES: Final = (4 << 30) + (4 << 20)


@dataclass(frozen=True)
class AdapterStatus:
    name: str
    version: int
    digest: str
    base_model: str
    nbytes: int
    pinned: bool
    leases: int
    source_dir: str


def status_of(s: pb.AdapterStatus) -> AdapterStatus:
    return AdapterStatus(
        s.name, s.version, s.digest, s.base_model, s.nbytes, s.pinned, s.leases, s.source_dir
    )


@dataclass(frozen=True)
class AdapterFiles:
    """One version's files, checked against its digest (``status.digest``)."""

    status: AdapterStatus
    config: bytes  # adapter_config.json
    weights: bytes  # adapter_model.safetensors


def resolve_adapter(
    stub: Any, name: str, model: str | None, load: bool, timeout: float | None
) -> AdapterStatus:
    request = pb.ResolveAdapterRequest(name=name, model=model or "", load=load)
    try:
        return status_of(stub.ResolveAdapter(request, timeout=timeout))
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


def fetch_adapter_files(
    stub: Any,
    name: str,
    version: int,
    *,
    timeout: float | None,
    chunk_bytes: int,
    max_bytes: int = MAX_ADAPTER_FILES_BYTES,
) -> AdapterFiles:
    """Both files of ``version`` of ``name`` (0: the current one), digest-checked."""
    request = pb.FetchAdapterFilesRequest(name=name, version=version, max_chunk_bytes=chunk_bytes)
    try:
        return _receive(name, stub.FetchAdapterFiles(request, timeout=timeout), max_bytes)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


def _receive(name: str, stream: Iterable[pb.AdapterFileChunk], max_bytes: int) -> AdapterFiles:
    status: AdapterStatus | None = None
    parts: dict[str, bytearray] = {}
    sizes: dict[str, int] = {}
    total = 0
    for msg in stream:
        if status is None:
            if not msg.HasField("adapter"):
                raise DataLossError(f"adapter {name!r}: the daemon did not say which version")
            status = status_of(msg.adapter)
        if msg.file not in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
            raise DataLossError(f"adapter {name!r}: the daemon sent an unknown file {msg.file!r}")
        got = parts.setdefault(msg.file, bytearray())
        size = sizes.setdefault(msg.file, msg.size)
        if not got and size:
            total += size
            if total > max_bytes:
                raise ResourceExhaustedError(
                    f"adapter {name!r}: {total} bytes of files, over this client's "
                    f"limit of {max_bytes}"
                )
        if msg.size != size or msg.offset != len(got) or len(got) + len(msg.data) > size:
            raise DataLossError(
                f"adapter {name!r}: {msg.file} arrived out of order (offset {msg.offset}, "
                f"{len(msg.data)} bytes, size {msg.size}; held {len(got)} of {size})"
            )
        got += msg.data
    if status is None:
        raise DataLossError(f"adapter {name!r}: the daemon sent nothing")
    for file in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if len(parts.get(file, b"")) != sizes.get(file, -1):
            raise DataLossError(f"adapter {name!r}: {file} arrived incomplete")
    config, weights = bytes(parts[ADAPTER_CONFIG_FILE]), bytes(parts[ADAPTER_WEIGHTS_FILE])
    digest = adapter_digest(hashlib.sha256(config).hexdigest(), hashlib.sha256(weights).hexdigest())
    if digest != status.digest:
        raise DataLossError(
            f"adapter {name!r} version {status.version}: the files received hash to {digest}, "
            f"the daemon verified {status.digest}"
        )
    return AdapterFiles(status, config, weights)
