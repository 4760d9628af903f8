"""The safetensors dtype table.

Sizes are kept in *bits* because safetensors also defines sub-byte types (F4, F6):
a tensor of those is only well formed when its element count times the width is a
whole number of bytes, and it can only be split on boundaries that keep that true.
"""

from __future__ import annotations

from typing import Final

#: Every dtype name the reference safetensors implementation accepts, with its width.
DTYPE_BITS: Final[dict[str, int]] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}


def nbytes_for(dtype: str, shape: tuple[int, ...] | list[int]) -> int | None:
    """Payload size of a tensor, or None when the elements do not fill whole bytes."""
    count = 1
    for dim in shape:
        count *= dim
    bits = count * DTYPE_BITS[dtype]
    if bits % 8:
        return None
    return bits // 8
