"""Pinned staging: register host packs as page-locked memory, within a byte budget.

A page-locked pack is copied to a GPU by DMA at full PCIe speed, without the driver's
bounce buffers; the daemon's own host-to-device copies (placing a pack for CUDA IPC)
use it. Packs are mapped read-only (they are sealed), so they are registered with
``CU_MEMHOSTREGISTER_READ_ONLY``; ``--pin`` checks at start that the GPU supports it.

Pinning is best effort within the budget: a pack that does not fit stays pageable,
is logged, and its grant says ``pinned: false``. Some drivers refuse single
registrations over 4 GB and containers cap locked memory (``ulimit -l``); a refusal
is logged with the driver's reason and the pack stays pageable. Everything
registered is unregistered before its mapping goes away.

**Unverified:** written without a GPU; see docs/design/same-host.md, "CUDA path status".
"""

from __future__ import annotations

import logging
import threading

from weightd.common.cuda_driver import CudaDriver, CudaDriverError

from ..packs.build import HostPack

log = logging.getLogger("weightd.pinned")


class HostPinner:
    def __init__(self, driver: CudaDriver, budget_bytes: int) -> None:
        self._driver = driver
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self.pinned_bytes = 0

    def pin(self, pack: HostPack) -> bool:
        """Page-lock ``pack`` if the budget allows; True when it is now pinned."""
        with self._lock:
            if self.pinned_bytes + pack.size > self.budget_bytes:
                log.info(
                    "pack %s (%d bytes) stays pageable: %d of %d pinned bytes in use",
                    pack.label,
                    pack.size,
                    self.pinned_bytes,
                    self.budget_bytes,
                )
                return False
            self.pinned_bytes += pack.size
        address = pack.address
        try:
            with self._driver.context(0):
                self._driver.host_register(address, pack.size, read_only=True)
        except CudaDriverError as exc:
            with self._lock:
                self.pinned_bytes -= pack.size
            log.warning("pack %s stays pageable: page-locking failed: %s", pack.label, exc)
            return False

        def unpin() -> None:
            try:
                with self._driver.context(0):
                    self._driver.host_unregister(address)
            except CudaDriverError as exc:
                log.error("unpinning pack %s failed: %s", pack.label, exc)
            with self._lock:
                self.pinned_bytes -= pack.size

        pack.set_pinned(unpin)
        return True
