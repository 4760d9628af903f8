"""safetensors dtype names → torch dtypes, with no silent casts.

A dtype torch lacks is an error, never a reinterpretation. FP4 (``F4``) is packed
two values per byte in torch's ``float4_e2m1fn_x2``, so its last dimension halves.
"""

from __future__ import annotations

import torch

from ..base.errors import FailedPreconditionError

_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "F4": "float4_e2m1fn_x2",
}


def torch_dtype(name: str, shape: tuple[int, ...]) -> tuple[torch.dtype, tuple[int, ...]]:
    """The torch dtype for a safetensors dtype, and the tensor shape in that dtype."""
    attr = _NAMES.get(name)
    dtype = getattr(torch, attr, None) if attr else None
    if not isinstance(dtype, torch.dtype):
        raise FailedPreconditionError(
            f"dtype {name} has no equivalent in torch {torch.__version__}; it is not cast"
        )
    if name == "F4":
        if not shape or shape[-1] % 2:
            raise FailedPreconditionError(
                f"F4 tensor of shape {list(shape)} cannot be packed in pairs"
            )
        shape = (*shape[:-1], shape[-1] // 2)
    return dtype, shape
