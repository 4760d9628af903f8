"""Slice digest hashers on the client: BLAKE3 where the package is there, else SHA-256.

Why BLAKE3 is optional here: the client is kept light (no daemon dependencies; a test
fetches with ``blake3`` blocked), but checking SHA-256 was a large share of the
client's CPU per byte (the gRPC notebook in ``docs/notes/``) and BLAKE3 is several
times faster per core. So a client
that can import ``blake3`` (installed with ``weightd`` itself, or on its own) asks the
daemon for BLAKE3 slice digests; one that cannot keeps SHA-256 from ``hashlib``. This
module is the one place in ``weightd.client`` allowed to import it (the import
contract in ``pyproject.toml`` names it).
"""

from __future__ import annotations

import hashlib
from typing import Any

from weightd.common.digests import BLAKE3, SLICE_DIGEST_ALGORITHM, Hasher

try:
    import blake3 as _blake3
except ImportError:  # a light client: SHA-256 only
    _blake3_module: Any = None
else:
    _blake3_module = _blake3


def available_kinds() -> tuple[str, ...]:
    """The slice digest kinds this process can check, fastest first."""
    if _blake3_module is None:
        return (SLICE_DIGEST_ALGORITHM,)
    return (BLAKE3, SLICE_DIGEST_ALGORITHM)


def preferred_kind() -> str:
    """What a client asks for by default: BLAKE3 when it can check it, else SHA-256."""
    return available_kinds()[0]


def new_hasher(kind: str) -> Hasher:
    """A fresh hasher of ``kind``; ``ValueError`` for a kind this process cannot check."""
    if kind == SLICE_DIGEST_ALGORITHM:
        return hashlib.sha256()
    if kind == BLAKE3 and _blake3_module is not None:
        hasher: Hasher = _blake3_module.blake3()
        return hasher
    raise ValueError(f"slice digest kind {kind!r} cannot be checked here ({available_kinds()})")
