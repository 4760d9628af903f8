"""The DLPack wrapper used for CUDA IPC memory, exercised on host memory (kDLCPU)."""

from __future__ import annotations

import ctypes
import gc

import torch

from weightd.client.transports.dlpack import KDL_CPU, bytes_tensor


def test_views_the_memory_and_calls_back_when_the_last_view_dies() -> None:
    buf = (ctypes.c_uint8 * 4096)(*[i % 251 for i in range(4096)])
    freed: list[int] = []
    t = bytes_tensor(ctypes.addressof(buf), 4096, KDL_CPU, 0, lambda: freed.append(1))
    assert t.dtype == torch.uint8 and t.shape == (4096,)
    assert t.data_ptr() == ctypes.addressof(buf)  # a view, not a copy
    assert t[:5].tolist() == [0, 1, 2, 3, 4]
    buf[0] = 99
    assert int(t[0]) == 99
    view = t[256:512].view(torch.int32)
    del t
    gc.collect()
    assert freed == []  # a view is still alive
    assert view.shape == (64,)
    del view
    gc.collect()
    assert freed == [1]
