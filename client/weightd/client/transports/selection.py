"""Which transport serves a fetch, and what the caller is told about it. Pure.

``transport="auto"`` tries, in order: CUDA IPC (a CUDA device and a daemon on this
host), shared memory (a daemon on this host: a ``unix://`` target whose side socket
``<socket>.local`` exists), then gRPC streaming. A faster transport that *fails* is
never skipped silently: the client logs a WARNING and records the failure in
:attr:`FetchInfo.fallbacks`; one that merely does not apply (no side socket, the
daemon offers no CUDA IPC, another GPU) is recorded as the reason for the choice.
An explicit transport never falls back: its failure is raised.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final, Literal

TRANSPORTS: Final = ("auto", "grpc", "shm", "cuda_ipc")
SIDE_SOCKET_SUFFIX: Final = ".local"


@dataclass(frozen=True)
class AdapterRef:
    """The adapter version an adapter pack holds (what ``FetchAdapter`` names in gRPC)."""

    name: str
    version: int
    digest: str
    base_model: str
    scaling: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class PackRef:
    """A granted pack, enough for another local process to attach to it (while it exists).

    ``boot_id`` names the daemon run that granted it: after a restart the daemon
    refuses it, so a stale CUDA IPC handle is never opened.
    """

    boot_id: str
    pack_id: int
    model: str
    tp_size: int
    tp_rank: int
    placement: Literal["host", "cuda"]
    size_bytes: int
    gpu_uuid: str = ""
    pinned: bool = False
    built: bool = False
    adapter: AdapterRef | None = None  # an adapter pack: the version it holds


@dataclass(frozen=True)
class TransportFailure:
    transport: str
    error: Exception

    def __str__(self) -> str:
        return f"{self.transport}: {self.error}"


@dataclass(frozen=True)
class FetchInfo:
    """How a fetch was served."""

    transport: str  # "grpc", "shm" or "cuda_ipc": what delivered the tensors
    requested: str
    reason: str  # why that transport (for "auto"), e.g. "no side socket at ..."
    fallbacks: tuple[TransportFailure, ...] = ()  # faster transports that failed first
    pack: PackRef | None = None  # shm / cuda_ipc: the pack the tensors came from
    copied: bool = False  # True: private tensors; False: views of the shared pack


def side_socket_path(target: str) -> str | None:
    """The side socket of a daemon at gRPC ``target``, or None if it is not a Unix socket."""
    if target.startswith("unix://"):
        path = target[len("unix://") :]
    elif target.startswith("unix:"):
        path = os.path.abspath(target[len("unix:") :])
    else:
        return None
    return path + SIDE_SOCKET_SUFFIX if path.startswith("/") else None


def candidates(
    requested: str, device_type: str, side_socket: str | None, side_exists: bool
) -> tuple[list[str], str]:
    """The transports to try, in order, and why.

    Raises ValueError for a request that makes no sense, LookupError when an explicitly
    requested same-host transport has no side socket to use.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"transport {requested!r} is not one of {', '.join(TRANSPORTS)}")
    if requested == "cuda_ipc" and device_type != "cuda":
        raise ValueError(f"transport 'cuda_ipc' needs a CUDA device, not {device_type!r}")
    if requested == "grpc":
        return ["grpc"], "asked for"
    if side_socket is None:
        missing = "the target is not a Unix socket, so the daemon is not known to be local"
    elif not side_exists:
        missing = f"no side socket at {side_socket} (daemon started with --no-shm?)"
    else:
        missing = ""
    if requested != "auto":
        if missing:
            raise LookupError(f"transport {requested!r} is unavailable: {missing}")
        return [requested], "asked for"
    if missing:
        return ["grpc"], missing
    if device_type == "cuda":
        return ["cuda_ipc", "shm", "grpc"], "CUDA device and a daemon on this host"
    return ["shm", "grpc"], "a daemon on this host"
