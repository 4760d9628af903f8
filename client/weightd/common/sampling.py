"""A sampled digest of a safetensors file's tensors: tells one checkpoint from another of
the same shapes (a fine-tune of the same base) by reading a few KiB per tensor.

Why per tensor and not a few places per file: a fine-tune changes whole tensors (every
element of the matrices it trained, often all of them, sometimes only some layers or
only the norms), so the first and last :data:`EDGE` bytes of *every* tensor catch any
tensor it trained, where a handful of file offsets would miss a small tensor or a
partial fine-tune. Reading cost: 8 KiB per tensor (a 70B checkpoint: ~6 MiB), against
the whole file for a full hash.

The digest covers, for each tensor in file order, its name, data offset and size and
those two edges, so a file whose header lists other tensors or offsets differs too.
Both sides compute it with :func:`sample_digest`: the daemon over its verified shard
(the tensors from its own strict parse), a client over its copy (the tensors from
:func:`header_tensors`, a bounded, strict-enough reading of the header).

Not a proof of identity: it decides "same checkpoint" from samples (a forgery built to
match them would pass; a mix-up does not). The same file on the same host
(device, inode, size, mtime) and a cache blob named by the file's SHA-256 are proofs,
and are preferred where they apply (``weightd.vllm.share.identity``).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from typing import Final

SCHEME: Final = "edges4k-sha256"
EDGE: Final = 4096
#: Largest header :func:`header_tensors` reads (what safetensors itself accepts).
MAX_HEADER_BYTES: Final = 100_000_000

#: ``read(offset, length) -> exactly length bytes`` (or raise).
Read = Callable[[int, int], bytes]


def sample_ranges(nbytes: int) -> list[tuple[int, int]]:
    """``(offset within the tensor, length)`` of what is sampled of a tensor (pure)."""
    if nbytes <= 2 * EDGE:
        return [(0, nbytes)] if nbytes else []
    return [(0, EDGE), (nbytes - EDGE, EDGE)]


def sample_digest(tensors: Iterable[tuple[str, int, int]], read: Read) -> str:
    """``"<scheme>:<hex>"`` of ``(name, file offset, nbytes)`` tensors' sampled bytes."""
    h = hashlib.sha256()
    for name, offset, nbytes in sorted(tensors, key=lambda t: (t[1], t[0])):
        encoded = name.encode("utf-8", "surrogatepass")
        h.update(struct.pack("<QQQ", len(encoded), offset, nbytes))
        h.update(encoded)
        for off, n in sample_ranges(nbytes):
            h.update(read(offset + off, n))
    return f"{SCHEME}:{h.hexdigest()}"


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"header names {k[:80]!r} twice")
        out[k] = v
    return out


def header_tensors(read: Read, file_size: int) -> list[tuple[str, int, int]]:
    """``(name, file offset, nbytes)`` of every tensor a safetensors file's header lists.

    ``ValueError`` for a header that is not one (too short, too long, not JSON, offsets
    out of the file): such a file is not the checkpoint a daemon verified.
    """
    if file_size < 8:
        raise ValueError(f"{file_size} bytes: too short for a safetensors header")
    (length,) = struct.unpack("<Q", read(0, 8))
    if length > min(MAX_HEADER_BYTES, file_size - 8):
        raise ValueError(f"header length {length} does not fit the {file_size}-byte file")
    try:
        header = json.loads(read(8, length), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not JSON: {exc}") from None
    except RecursionError:  # the parser recurses once per nested list or object
        raise ValueError("header is not a safetensors header: nested too deep") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    base = 8 + length
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= file_size - base
        ):
            raise ValueError(f"tensor {name[:80]!r}: data_offsets out of the file")
        out.append((name, base + offsets[0], offsets[1] - offsets[0]))
    return out
