"""Wrap memory torch did not allocate (a CUDA IPC mapping) as a tensor, without NumPy.

``torch.as_tensor`` on a ``__cuda_array_interface__`` object parses the type string
with NumPy, which a worker need not have. A DLPack capsule is what torch itself
consumes for foreign memory: built here with ``ctypes``, it hands torch a pointer,
a size and a deleter that torch calls when the last tensor viewing the memory dies,
which is when weightd closes the IPC handle and ends the lease.

The same code path works for host memory (``kDLCPU``), which is how it is tested on
machines without a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable
from typing import Final

import torch

KDL_CPU: Final = 1
KDL_CUDA: Final = 2
_KDL_UINT: Final = 1


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [
    ("dl_tensor", _Tensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_lock = threading.Lock()
_ids = itertools.count(1)
#: manager id → (the struct torch points at, its shape array, what to run when freed)
_live: dict[int, tuple[_Managed, ctypes.Array[ctypes.c_int64], Callable[[], None]]] = {}


def _delete(managed: ctypes._Pointer[_Managed]) -> None:
    key = managed.contents.manager_ctx or 0
    with _lock:
        entry = _live.pop(key, None)
    if entry is not None:
        entry[2]()


#: The C callback torch calls; module-level so it outlives every tensor it frees.
_delete_c = _DELETER(_delete)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def bytes_tensor(
    address: int, nbytes: int, device_type: int, device_id: int, on_free: Callable[[], None]
) -> torch.Tensor:
    """A 1-D uint8 tensor over ``nbytes`` at ``address``; ``on_free`` runs when torch lets go.

    ``on_free`` may run on any thread (torch frees storage where the last reference
    dies) and must not raise.
    """
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _Managed()
    managed.dl_tensor.data = address
    managed.dl_tensor.device = _Device(device_type, device_id)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.dl_tensor.byte_offset = 0
    managed.deleter = _delete_c
    with _lock:
        key = next(_ids)
        _live[key] = (managed, shape, on_free)
    managed.manager_ctx = key
    try:
        capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _lock:
            _live.pop(key, None)
        raise
