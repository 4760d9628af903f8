"""CUDA IPC on the client: open the daemon's GPU-resident pack and view tensors in it.

The daemon keeps each rank pack in one ``cuMemAlloc`` block of its own and sends its
IPC handle with the table. The client checks the pack is on *its* GPU (by UUID:
ordinals differ under ``CUDA_VISIBLE_DEVICES``), opens the handle with the driver
API and wraps the memory as tensors through DLPack (no NumPy needed). The tensors
view the daemon's memory: **read-only by contract**, since a write would change
the weights of every worker sharing the pack. ``copy=True`` returns device-to-device
copies and ends the lease at once.

A handle can be opened only once per process, so opened handles are cached and
reference-counted per process; the last tensor freed closes the handle
(``cuIpcCloseMemHandle``) and then the lease's connection.

Container requirements (see docs/design/same-host.md): host IPC namespace (``--ipc=host``), host PID
namespace or at least distinct PIDs (``--pid=host``), the daemon and workers seeing
the same GPUs (any order: matched by UUID).

**Unverified:** written on machines without a GPU; the ``gpu`` tests exercise it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import torch

from weightd.common.cuda_driver import CudaDriver, CudaDriverError, canonical_uuid
from weightd.common.digests import slice_digest

from ..base.errors import DataLossError, FailedPreconditionError, UnavailableError
from ..base.request import Delivery
from ..receive.hashers import new_hasher
from .dlpack import KDL_CUDA, bytes_tensor
from .local import LocalConnection
from .localwire import Grant
from .shm import pack_table

log = logging.getLogger("weightd.client.transports.cuda_ipc")

_lock = threading.Lock()
_driver: CudaDriver | None = None


@dataclass
class _Opened:
    ptr: int
    ordinal: int
    refs: int


_opened: dict[bytes, _Opened] = {}


def driver() -> CudaDriver:
    global _driver  # noqa: PLW0603 - one driver binding per process
    with _lock:
        if _driver is None:
            try:
                _driver = CudaDriver.load()
            except CudaDriverError as exc:
                raise UnavailableError(str(exc), transport="cuda_ipc") from None
        return _driver


def device_uuid(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return canonical_uuid(str(torch.cuda.get_device_properties(index).uuid))


def _open(handle: bytes, gpu_uuid: str, ordinal: int) -> _Opened:
    """Open (or share this process's opening of) ``handle`` on torch's device ``ordinal``."""
    d = driver()
    with _lock:
        opened = _opened.get(handle)
        if opened is not None:
            opened.refs += 1
            return opened
    try:
        seen = d.device_uuid(ordinal)
        if seen != gpu_uuid:
            # torch and the driver disagree on ordinals (CUDA_DEVICE_ORDER?): refuse
            # rather than hand torch a pointer it would place on the wrong device.
            raise FailedPreconditionError(
                f"device {ordinal} is GPU {gpu_uuid} to torch but {seen} to the driver",
                transport="cuda_ipc",
            )
        with d.context(ordinal):
            ptr = d.ipc_open(handle)
    except CudaDriverError as exc:
        raise UnavailableError(
            f"opening the CUDA IPC handle: {exc}", transport="cuda_ipc"
        ) from None
    with _lock:
        raced = _opened.get(handle)
        if raced is None:
            opened = _opened[handle] = _Opened(ptr, ordinal, 1)
            return opened
        raced.refs += 1
    with d.context(ordinal):
        d.ipc_close(ptr)  # another thread opened it first; keep theirs
    return raced


def _close(handle: bytes, conn: LocalConnection) -> None:
    """Runs when torch frees the last tensor of a lease: unmap (if last), then end the lease."""
    try:
        with _lock:
            opened = _opened[handle]
            opened.refs -= 1
            last = opened.refs == 0
            if last:
                del _opened[handle]
        if last:
            d = driver()
            with d.context(opened.ordinal):
                d.ipc_close(opened.ptr)
    except Exception:
        # torch's deleter must not raise; the failure is still reported, never dropped.
        log.exception("closing a CUDA IPC handle failed")
    finally:
        conn.close()


def map_cuda_pack(
    grant: Grant, conn: LocalConnection, delivery: Delivery
) -> dict[str, torch.Tensor]:
    """Tensors for the grant's entries on ``delivery.device``. Takes ownership of ``conn``
    (the lease)."""
    copy, verify, device = delivery.copy, delivery.verify, delivery.torch_device()
    try:
        want = device_uuid(device)
        if canonical_uuid(grant.gpu_uuid) != want:
            raise FailedPreconditionError(
                f"the daemon placed pack {grant.pack_id} on GPU {grant.gpu_uuid}, not on "
                f"{device} ({want})",
                transport="cuda_ipc",
            )
        table = pack_table(grant)
        index = device.index if device.index is not None else torch.cuda.current_device()
        opened = _open(grant.cuda_ipc_handle, want, index)
    except BaseException:
        conn.close()
        raise
    handle = bytes(grant.cuda_ipc_handle)
    try:
        base = bytes_tensor(
            opened.ptr, grant.size_bytes, KDL_CUDA, index, lambda: _close(handle, conn)
        )
    except BaseException:
        _close(handle, conn)
        raise
    views: dict[str, torch.Tensor] = {}
    for e, dtype, shape in table:
        raw = base[e.offset : e.offset + e.nbytes]
        views[e.name] = (
            raw.view(dtype).view(shape)
            if e.nbytes
            else torch.empty(shape, dtype=dtype, device=device)
        )
    del base
    if verify:
        try:
            _verify(views, grant)
        except BaseException:
            views.clear()
            raise
    if not copy:
        return views
    out = {n: t.clone() for n, t in views.items()}
    torch.cuda.current_stream(device).synchronize()  # copies done before the lease ends
    views.clear()  # the last views go: torch calls the deleter, which ends the lease
    return out


def _verify(views: dict[str, torch.Tensor], grant: Grant) -> None:
    """Hash every slice (copied to the host) against the table: slow, opt-in."""
    for e in grant.entries:
        t = views[e.name]
        kind = e.digest.partition(":")[0]
        try:
            h = new_hasher(kind)
        except ValueError as exc:
            raise DataLossError(f"pack {grant.pack_id}: tensor {e.name!r}: {exc}") from None
        if e.nbytes:
            host = t.reshape(-1).view(torch.uint8).cpu()
            # A ctypes array over the host copy: the buffer protocol without NumPy.
            h.update(memoryview((ctypes.c_char * e.nbytes).from_address(host.data_ptr())).cast("B"))
        actual = slice_digest(h, kind)
        if actual != e.digest:
            raise DataLossError(
                f"pack {grant.pack_id}: tensor {e.name!r} on the GPU hashes to {actual}, the "
                f"table says {e.digest}"
            )
