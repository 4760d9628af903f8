"""CUDA IPC placement: a rank pack copied to a GPU in an allocation of its own.

An IPC handle exports the whole ``cuMemAlloc`` block a pointer lies in, so each pack
gets exactly one allocation, never shared with another pack or model (torch's caching
allocator is bypassed for that reason; see ``weightd.common.cuda_driver``). The copy
comes from the sealed, verified host pack, page-locked when ``--pin`` allows, so the
device bytes are the verified bytes. GPUs are named by UUID: ordinals differ between
processes with different ``CUDA_VISIBLE_DEVICES``.

The allocation lives until the pack is freed, which the pack cache does only when no
lease holds it; leases are tied to the client's side-channel connection, which ends
when the client's process does, so a killed worker cannot pin GPU memory forever.

**Unverified:** written without a GPU; see docs/design/same-host.md, "CUDA path status".
"""

from __future__ import annotations

import logging
import time

from weightd.common.cuda_driver import CudaDriver, CudaDriverError

from ..base.cleanup import on_error
from ..base.errors import CudaFailure, PackMemoryExhausted, PlacementUnavailable
from ..packs.build import HostPack, PackEntry

log = logging.getLogger("weightd.cuda_ipc")


class CudaPack:
    """A pack's copy on one GPU, and the IPC handle that exports it."""

    def __init__(
        self,
        driver: CudaDriver,
        ordinal: int,
        gpu_uuid: str,
        ptr: int,
        size: int,
        handle: bytes,
        entries: tuple[PackEntry, ...],
        label: str,
    ) -> None:
        self._driver = driver
        self.ordinal = ordinal
        self.gpu_uuid = gpu_uuid
        self.ptr = ptr
        self.size = size
        self.handle = handle
        self.entries = entries
        self.label = label
        self._freed = False

    def close(self) -> None:
        if self._freed:
            return
        self._freed = True
        try:
            with self._driver.context(self.ordinal):
                self._driver.mem_free(self.ptr)
        except CudaDriverError as exc:
            log.error("freeing GPU pack %s failed: %s", self.label, exc)


class CudaPlacer:
    def __init__(self, driver: CudaDriver) -> None:
        self._driver = driver
        #: canonical GPU UUID → this daemon's ordinal
        self.gpus = driver.uuids()

    def place(self, host: HostPack, gpu_uuid: str) -> CudaPack:
        ordinal = self.gpus.get(gpu_uuid)
        if ordinal is None:
            raise PlacementUnavailable(
                f"GPU {gpu_uuid} is not visible to the daemon (it sees {sorted(self.gpus)}); "
                "run it with the same GPUs visible as its workers"
            )
        started = time.monotonic()
        try:
            with self._driver.context(ordinal):
                try:
                    ptr = self._driver.mem_alloc(host.size)
                except CudaDriverError as exc:
                    if "OUT_OF_MEMORY" in exc.detail:
                        raise PackMemoryExhausted(
                            f"GPU {gpu_uuid} has no room for pack {host.label} "
                            f"({host.size} bytes): {exc}"
                        ) from None
                    raise
                with on_error(lambda: self._driver.mem_free(ptr), f"GPU memory of {host.label}"):
                    self._driver.set_sync_memops(ptr)
                    self._driver.memcpy_htod(ptr, host.address, host.size)
                    handle = self._driver.ipc_get_handle(ptr)
        except CudaDriverError as exc:
            raise CudaFailure(f"placing pack {host.label} on GPU {gpu_uuid}: {exc}") from None
        seconds = time.monotonic() - started
        log.info(
            "placed pack %s on GPU %s (ordinal %d): %d bytes in %.3fs (%.2f GB/s, %s)",
            host.label,
            gpu_uuid,
            ordinal,
            host.size,
            seconds,
            host.size / max(seconds, 1e-9) / 1e9,
            "pinned" if host.pinned else "pageable",
        )
        return CudaPack(
            self._driver, ordinal, gpu_uuid, ptr, host.size, handle, host.entries, host.label
        )
