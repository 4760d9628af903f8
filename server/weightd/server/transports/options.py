"""Configuration of the same-host transports: one dataclass, its CLI flags, its checks.

Flags that need CUDA (``--pin``, ``--cuda-ipc``) are checked at start, before the
daemon listens anywhere, so a host without a usable driver fails with one line
instead of serving without the staging the operator asked for.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Final

from weightd.common.cuda_driver import (
    CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
    CudaDriver,
    CudaDriverError,
)

from ..base.errors import CudaUnavailable, UsageError

#: The side socket lives next to the gRPC socket, in the same 0700 directory.
LOCAL_SOCKET_SUFFIX: Final = ".local"
DEFAULT_TTL_SECONDS: Final = 300.0
DEFAULT_CUDA_BUDGET_BYTES: Final = 16 << 30
DEFAULT_MAX_CONNECTIONS: Final = 1024
#: A client has this long from connecting to deliver its whole request.
DEFAULT_REQUEST_SECONDS: Final = 30.0


@dataclass
class LocalConfig:
    """What ``weightd serve`` is told about same-host transports."""

    #: Open the side socket (``<socket>.local``) when listening on a Unix socket.
    enabled: bool = True
    #: Bytes of rank packs held in shared memory; 0: half of physical memory.
    host_budget_bytes: int = 0
    #: Seconds an unleased pack is kept for the next asker before it is freed.
    ttl_seconds: float = DEFAULT_TTL_SECONDS
    #: Register host packs as page-locked memory (needs CUDA).
    pin: bool = False
    #: Bytes of packs that may be page-locked at once; 0: the shared-memory budget.
    pin_budget_bytes: int = 0
    #: Place packs on GPUs and hand out CUDA IPC handles (needs CUDA).
    cuda_ipc: bool = False
    #: Bytes of packs per GPU.
    cuda_budget_bytes: int = DEFAULT_CUDA_BUDGET_BYTES
    #: Open side-channel connections (one per lease) beyond which new ones are refused.
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: Seconds a connection has, from connecting, to deliver its whole request.
    request_seconds: float = DEFAULT_REQUEST_SECONDS

    def resolved_host_budget(self) -> int:
        if self.host_budget_bytes > 0:
            return self.host_budget_bytes
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2

    def resolved_pin_budget(self) -> int:
        return self.pin_budget_bytes if self.pin_budget_bytes > 0 else self.resolved_host_budget()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("same-host transports (shared memory, pinned staging, CUDA IPC)")
    g.add_argument(
        "--no-shm",
        dest="shm",
        action="store_false",
        help="do not open the side socket <socket>.local (no shared-memory packs, no CUDA IPC)",
    )
    g.add_argument(
        "--shm-budget-bytes",
        type=int,
        default=0,
        help="bytes of rank packs kept in shared memory (default: half of physical memory)",
    )
    g.add_argument(
        "--pack-ttl",
        type=float,
        default=DEFAULT_TTL_SECONDS,
        help="seconds an unleased pack is kept before it is freed",
    )
    g.add_argument("--pin", action="store_true", help="page-lock packs (needs CUDA)")
    g.add_argument(
        "--pin-budget-bytes",
        type=int,
        default=0,
        help="bytes of packs page-locked at once (default: the shared-memory budget)",
    )
    g.add_argument(
        "--cuda-ipc", action="store_true", help="place packs on GPUs, hand out CUDA IPC handles"
    )
    g.add_argument(
        "--cuda-budget-bytes",
        type=int,
        default=DEFAULT_CUDA_BUDGET_BYTES,
        help="bytes of packs per GPU",
    )
    g.add_argument(
        "--side-max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="side-socket connections (one per lease) beyond which new ones are refused "
        "with RESOURCE_EXHAUSTED",
    )
    g.add_argument(
        "--side-request-seconds",
        type=float,
        default=DEFAULT_REQUEST_SECONDS,
        help="seconds a side-socket client has, from connecting, to send its whole request",
    )


def from_arguments(args: argparse.Namespace) -> LocalConfig:
    return LocalConfig(
        enabled=args.shm,
        host_budget_bytes=args.shm_budget_bytes,
        ttl_seconds=args.pack_ttl,
        pin=args.pin,
        pin_budget_bytes=args.pin_budget_bytes,
        cuda_ipc=args.cuda_ipc,
        cuda_budget_bytes=args.cuda_budget_bytes,
        max_connections=args.side_max_connections,
        request_seconds=args.side_request_seconds,
    )


def check_config(config: LocalConfig, unix_socket: bool) -> CudaDriver | None:
    """Refuse contradictory or unsatisfiable options; load the CUDA driver when one needs it."""
    if config.max_connections < 1 or config.request_seconds <= 0:
        raise UsageError("--side-max-connections and --side-request-seconds must be positive")
    wants = [flag for flag, on in (("--pin", config.pin), ("--cuda-ipc", config.cuda_ipc)) if on]
    if not wants:
        return None
    if not (config.enabled and unix_socket):
        raise CudaUnavailable(
            f"{' and '.join(wants)} need the side socket, which exists only with a unix:// "
            "--listen address and without --no-shm"
        )
    try:
        driver = CudaDriver.load()
        count = driver.device_count()
    except CudaDriverError as exc:
        raise CudaUnavailable(
            f"{' and '.join(wants)} need CUDA, and this host has none usable: {exc}"
        ) from None
    if count == 0:
        raise CudaUnavailable(f"{' and '.join(wants)} need CUDA, and no GPU is visible")
    if config.pin:
        try:
            supported = driver.device_attribute(
                CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, 0
            )
        except CudaDriverError as exc:
            raise CudaUnavailable(f"--pin: cannot query GPU 0: {exc}") from None
        if not supported:
            raise CudaUnavailable(
                "--pin: GPU 0 cannot page-lock read-only memory "
                "(CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is 0); packs are sealed "
                "and mapped read-only, so they cannot be pinned here"
            )
    return driver
