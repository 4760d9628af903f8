"""Configuration of the same-host transports: one dataclass and its checks (the settings
themselves are declared in :mod:`weightd.server.config.schema`).

Flags that need CUDA (``--pin``, ``--cuda-ipc``) are checked at start, before the
daemon listens anywhere, so a host without a usable driver fails with one line
instead of serving without the staging the operator asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

from weightd.common.cuda_driver import (
    CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED,
    CudaDriver,
    CudaDriverError,
)

from ..base.errors import CudaUnavailable, UsageError
from ..plan.declared import DeclaredLayout

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
    #: Connections one user other than the daemon's (the peer's uid) may hold at once;
    #: 0: half of ``max_connections``, so another user of the daemon's group never
    #: takes them all from the daemon's own engines.
    max_connections_per_user: int = 0

    def resolved_per_user(self) -> int:
        if self.max_connections_per_user > 0:
            return min(self.max_connections_per_user, self.max_connections)
        return max(1, self.max_connections // 2)

    def resolved_host_budget(self) -> int:
        if self.host_budget_bytes > 0:
            return self.host_budget_bytes
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2

    def resolved_pin_budget(self) -> int:
        return self.pin_budget_bytes if self.pin_budget_bytes > 0 else self.resolved_host_budget()


#: Default of ``local.max_remembered_layouts``.
DEFAULT_MAX_REMEMBERED: Final = 2


@dataclass(frozen=True)
class PrebuildOptions:
    """What ``weightd serve`` says about declared layouts (built in ``config/build.py``)."""

    declared: tuple[DeclaredLayout, ...] = ()
    #: Remember the layouts workers ask for, and build them at the next load.
    remember: bool = True
    #: Remembered layouts built at a load or publish besides the declared ones: what
    #: any worker asked for is remembered, so this bounds what a client can make
    #: every later load build (most recently asked first).
    max_remembered: int = DEFAULT_MAX_REMEMBERED
    #: Drop a model's shard pages from the page cache once its declared packs are built.
    drop_shard_pages: bool = True
    #: Threads a layout's build uses (None: every core).
    threads: int | None = None


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
