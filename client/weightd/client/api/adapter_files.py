"""An adapter's status, and one version's two files as the daemon verified them.

For engines that read PEFT's own files (vLLM loads a LoRA adapter from a directory):
the daemon sends ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as it
read and verified them, and :func:`fetch_adapter_files` checks that their SHA-256s give
the version's digest (the one an operator can pin), so what an engine writes out
and loads is byte for byte what the daemon verified. torch-free: the CLI and vLLM's
API server process use it without making tensors.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import grpc

from weightd.common.digests import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_digest
from weightd.v1 import weightd_pb2 as pb

from ..base.errors import DataLossError, ResourceExhaustedError, from_rpc_error

#: Largest adapter (both files) a client accepts unless told otherwise: the daemon's
#: own limit for the weights file plus its config limit.
MAX_ADAPTER_FILES_BYTES: Final = (4 << 30) + (4 << 20)


@dataclass(frozen=True)
class AdapterStatus:
    """One adapter version as the daemon holds it (``resolve_adapter``, ``AdminClient``).

    ``digest`` is the version's digest over its two files (the one an operator pins);
    ``base_model`` the served model it applies to; ``nbytes`` its weights' size;
    ``pinned``: loaded by the operator, never evicted; ``leases``: fetches and workers
    holding this version now; ``source_dir``: where the daemon read it.
    """

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
    config: bytes | bytearray  # adapter_config.json
    weights: bytes | bytearray  # adapter_model.safetensors


def resolve_adapter(
    stub: Any, name: str, model: str | None, load: bool, timeout: float | None
) -> AdapterStatus:
    request = pb.ResolveAdapterRequest(name=name, model=model or "", load=load)
    try:
        return status_of(stub.ResolveAdapter(request, timeout=timeout))
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


class _Memory:
    """Each file into one bytearray of its announced size."""

    def __init__(self) -> None:
        self.files: dict[str, bytearray] = {}

    def open(self, file: str, size: int) -> None:
        self.files[file] = bytearray(size)

    def write(self, file: str, offset: int, data: bytes) -> None:
        self.files[file][offset : offset + len(data)] = data


class _Directory:
    """Each file written, as it arrives, into a new file (0400) in ``directory``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.fds: dict[str, int] = {}

    def open(self, file: str, size: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fds[file] = os.open(os.path.join(self.directory, file), flags, 0o400)

    def write(self, file: str, offset: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fds[file], view) :]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _request(name: str, version: int, chunk_bytes: int) -> pb.FetchAdapterFilesRequest:
    return pb.FetchAdapterFilesRequest(name=name, version=version, max_chunk_bytes=chunk_bytes)


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
    sink = _Memory()
    try:
        stream = stub.FetchAdapterFiles(_request(name, version, chunk_bytes), timeout=timeout)
        status = _receive(name, stream, max_bytes, sink)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    return AdapterFiles(status, sink.files[ADAPTER_CONFIG_FILE], sink.files[ADAPTER_WEIGHTS_FILE])


def fetch_adapter_files_into(
    stub: Any,
    name: str,
    version: int,
    directory: str,
    *,
    timeout: float | None,
    chunk_bytes: int,
    max_bytes: int = MAX_ADAPTER_FILES_BYTES,
) -> AdapterStatus:
    """:func:`fetch_adapter_files`, each file written into ``directory`` as it arrives
    (new files, 0400; nothing held in memory). Raises when the files do not give the
    version's digest: the caller must then discard ``directory``."""
    sink = _Directory(directory)
    try:
        stream = stub.FetchAdapterFiles(_request(name, version, chunk_bytes), timeout=timeout)
        return _receive(name, stream, max_bytes, sink)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    finally:
        sink.close()


def _receive(
    name: str,
    stream: Iterable[pb.AdapterFileChunk],
    max_bytes: int,
    sink: _Memory | _Directory,
) -> AdapterStatus:
    """Both files into ``sink``, hashed as they arrive, checked against the version's digest."""
    status: AdapterStatus | None = None
    hashes: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    held: dict[str, int] = {}
    for msg in stream:
        if status is None:
            if not msg.HasField("adapter"):
                raise DataLossError(f"adapter {name!r}: the daemon did not say which version")
            status = status_of(msg.adapter)
        if msg.file not in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
            raise DataLossError(f"adapter {name!r}: the daemon sent an unknown file {msg.file!r}")
        if msg.file not in sizes:
            if sum(sizes.values()) + msg.size > max_bytes:
                raise ResourceExhaustedError(
                    f"adapter {name!r}: {sum(sizes.values()) + msg.size} bytes of files, over "
                    f"this client's limit of {max_bytes}"
                )
            sizes[msg.file], held[msg.file] = msg.size, 0
            hashes[msg.file] = hashlib.sha256()
            sink.open(msg.file, msg.size)
        size, got = sizes[msg.file], held[msg.file]
        if msg.size != size or msg.offset != got or got + len(msg.data) > size:
            raise DataLossError(
                f"adapter {name!r}: {msg.file} arrived out of order (offset {msg.offset}, "
                f"{len(msg.data)} bytes, size {msg.size}; held {got} of {size})"
            )
        sink.write(msg.file, got, msg.data)
        hashes[msg.file].update(msg.data)
        held[msg.file] = got + len(msg.data)
    if status is None:
        raise DataLossError(f"adapter {name!r}: the daemon sent nothing")
    for file in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        if file not in sizes or held[file] != sizes[file]:
            raise DataLossError(f"adapter {name!r}: {file} arrived incomplete")
    digest = adapter_digest(
        hashes[ADAPTER_CONFIG_FILE].hexdigest(), hashes[ADAPTER_WEIGHTS_FILE].hexdigest()
    )
    if digest != status.digest:
        raise DataLossError(
            f"adapter {name!r} version {status.version}: the files received hash to {digest}, "
            f"the daemon verified {status.digest}"
        )
    return status
