"""The few CUDA driver API calls weightd's GPU paths need, through ``ctypes``.

Why the driver API and not torch: an IPC handle exports the *whole* allocation a
pointer lives in. torch's caching allocator carves tensors out of shared segments
(and with ``expandable_segments`` out of one growing mapping), so a handle to a
torch tensor can expose its neighbours. ``cuMemAlloc`` gives each rank pack one
allocation of its own, whatever the allocator is configured to do. The same binding
pins host memory (``cuMemHostRegister``) and opens handles on the client side,
and needs only the standard library and the NVIDIA driver's ``libcuda.so.1``.

**Unverified:** this module was written on machines without a GPU; the ``gpu``
tests exercise it where CUDA exists (see docs/design/same-host.md, "CUDA path status").
"""

from __future__ import annotations

import ctypes
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: Final = 0x1
CU_MEMHOSTREGISTER_PORTABLE: Final = 0x01
CU_MEMHOSTREGISTER_READ_ONLY: Final = 0x08
CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: Final = 6
CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED: Final = 113
IPC_HANDLE_BYTES: Final = 64


class CudaDriverError(Exception):
    """A driver call failed, or the driver could not be loaded at all."""

    def __init__(self, call: str, detail: str) -> None:
        super().__init__(f"{call}: {detail}")
        self.call = call
        self.detail = detail


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


def canonical_uuid(text_or_bytes: str | bytes) -> str:
    """GPU UUIDs in one spelling: nvidia-smi's ``GPU-...``, torch's and raw 16 bytes agree."""
    if isinstance(text_or_bytes, bytes):
        return str(uuid.UUID(bytes=text_or_bytes))
    text = text_or_bytes.strip()
    if text.upper().startswith("GPU-"):
        text = text[4:]
    return str(uuid.UUID(text))


class CudaDriver:
    """A loaded ``libcuda.so.1`` with ``cuInit`` done. Thread-safe; one per process is enough."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._call("cuInit", ctypes.c_uint(0))

    @classmethod
    def load(cls) -> CudaDriver:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaDriverError(
                "load libcuda.so.1", f"{exc} (no NVIDIA driver visible to this process)"
            ) from None
        return cls(lib)

    # --- plumbing ---------------------------------------------------------------------

    def _fn(self, name: str) -> Any:
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            raise CudaDriverError(name, "not exported by this driver (too old?)") from None
        fn.restype = ctypes.c_int
        return fn

    def _call(self, name: str, *args: object) -> None:
        result = self._fn(name)(*args)
        if result != 0:
            raise CudaDriverError(name, self._describe(int(result)))

    def _describe(self, result: int) -> str:
        text = ctypes.c_char_p()
        label = ctypes.c_char_p()
        self._fn("cuGetErrorName")(result, ctypes.byref(label))
        self._fn("cuGetErrorString")(result, ctypes.byref(text))
        name = label.value.decode() if label.value else f"CUresult {result}"
        return f"{name}: {text.value.decode() if text.value else 'unknown error'}"

    # --- devices and contexts ----------------------------------------------------------

    def device_count(self) -> int:
        n = ctypes.c_int()
        self._call("cuDeviceGetCount", ctypes.byref(n))
        return n.value

    def device_uuid(self, ordinal: int) -> str:
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        raw = _Uuid()
        try:
            self._call("cuDeviceGetUuid_v2", ctypes.byref(raw), dev)
        except CudaDriverError:
            self._call("cuDeviceGetUuid", ctypes.byref(raw), dev)
        return canonical_uuid(bytes(raw.bytes))

    def uuids(self) -> dict[str, int]:
        """Canonical UUID → this process's ordinal, for every GPU it can see."""
        return {self.device_uuid(i): i for i in range(self.device_count())}

    def device_attribute(self, attribute: int, ordinal: int) -> int:
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(attribute), dev)
        return value.value

    @contextmanager
    def context(self, ordinal: int) -> Iterator[None]:
        """Make ``ordinal``'s primary context (the one torch uses too) current in this thread."""
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                dev = ctypes.c_int()
                self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
                ctx = ctypes.c_void_p()
                # Retained for the life of the process: primary contexts are shared with
                # torch and cheap to keep; releasing could tear one down under torch.
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
                self._contexts[ordinal] = ctx
        self._call("cuCtxPushCurrent_v2", ctx)
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self._call("cuCtxPopCurrent_v2", ctypes.byref(popped))

    # --- memory (call inside ``context``) -----------------------------------------------

    def mem_alloc(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
        return ptr.value

    def mem_free(self, ptr: int) -> None:
        self._call("cuMemFree_v2", ctypes.c_uint64(ptr))

    def memcpy_htod(self, dst: int, src_address: int, size: int) -> None:
        self._call(
            "cuMemcpyHtoD_v2",
            ctypes.c_uint64(dst),
            ctypes.c_void_p(src_address),
            ctypes.c_size_t(size),
        )

    def memcpy_dtoh(self, dst_address: int, src: int, size: int) -> None:
        self._call(
            "cuMemcpyDtoH_v2",
            ctypes.c_void_p(dst_address),
            ctypes.c_uint64(src),
            ctypes.c_size_t(size),
        )

    def set_sync_memops(self, ptr: int) -> None:
        """Recommended for exported memory: copies touching it complete before returning."""
        one = ctypes.c_uint(1)
        self._call(
            "cuPointerSetAttribute",
            ctypes.byref(one),
            ctypes.c_int(CU_POINTER_ATTRIBUTE_SYNC_MEMOPS),
            ctypes.c_uint64(ptr),
        )

    def ipc_get_handle(self, ptr: int) -> bytes:
        handle = _IpcHandle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(ptr))
        return bytes(handle.reserved)

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise CudaDriverError("cuIpcOpenMemHandle", f"handle has {len(handle)} bytes, not 64")
        h = _IpcHandle()
        h.reserved = handle
        ptr = ctypes.c_uint64()
        fn = self._fn("cuIpcOpenMemHandle_v2")
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        result = fn(ctypes.byref(ptr), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        if result != 0:
            raise CudaDriverError("cuIpcOpenMemHandle_v2", self._describe(int(result)))
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self._call("cuIpcCloseMemHandle", ctypes.c_uint64(ptr))

    def host_register(self, address: int, size: int, *, read_only: bool) -> None:
        flags = CU_MEMHOSTREGISTER_PORTABLE | (CU_MEMHOSTREGISTER_READ_ONLY if read_only else 0)
        self._call(
            "cuMemHostRegister_v2",
            ctypes.c_void_p(address),
            ctypes.c_size_t(size),
            ctypes.c_uint(flags),
        )

    def host_unregister(self, address: int) -> None:
        self._call("cuMemHostUnregister", ctypes.c_void_p(address))
