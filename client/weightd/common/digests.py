"""Self-describing digests: ``"<algorithm>:<lowercase hex>"``, and the slice digest kinds.

Slice digests come in two kinds, chosen per Fetch by the client
(``FetchRequest.slice_digest``):

* ``sha256``, the default and what every daemon sends: every client can check it with
  the standard library alone (``hashlib``, SHA-NI accelerated where the CPU has it);
* ``blake3``, asked for by clients that have the ``blake3`` package: several times
  faster per core, on both sides, and the algorithm the daemon already verifies whole
  tensors with.

Both are collision resistant, so a digest anchored in a trusted manifest can be
forwarded to clients without weakening the chain of trust: whichever kind a slice's
digest is, the daemon computed it from bytes it had first proven to be the verified
tensor.
"""

from __future__ import annotations

import hashlib
from typing import Final, Protocol

SLICE_DIGEST_ALGORITHM: Final = "sha256"
#: The faster kind a client may ask for (``FetchRequest.slice_digest``).
BLAKE3: Final = "blake3"
#: Every kind a daemon serves; "" on the wire means the default, SHA-256.
SLICE_DIGEST_KINDS: Final = (SLICE_DIGEST_ALGORITHM, BLAKE3)


class Hasher(Protocol):
    """What ``hashlib.sha256()`` and ``blake3.blake3()`` both provide."""

    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def format_digest(algorithm: str, hexdigest: str) -> str:
    return f"{algorithm}:{hexdigest}"


def slice_kind(requested: str) -> str:
    """The slice digest kind a request's ``slice_digest`` field names ("" is SHA-256).

    Raises ``ValueError`` for any other value (the daemon answers INVALID_ARGUMENT).
    """
    kind = requested or SLICE_DIGEST_ALGORITHM
    if kind not in SLICE_DIGEST_KINDS:
        raise ValueError(
            f"slice_digest {requested[:64]!r} is not one of {', '.join(SLICE_DIGEST_KINDS)}"
        )
    return kind


def slice_digest(hasher: Hasher, algorithm: str = SLICE_DIGEST_ALGORITHM) -> str:
    return format_digest(algorithm, hasher.hexdigest())


#: The two files of a PEFT LoRA adapter weightd serves, in digest order.
ADAPTER_CONFIG_FILE: Final = "adapter_config.json"
ADAPTER_WEIGHTS_FILE: Final = "adapter_model.safetensors"


def adapter_digest(config_sha256: str, weights_sha256: str) -> str:
    """An adapter's one digest, which an operator can pin: SHA-256 of both files' SHA-256s.

    Covers the config too, since ``lora_alpha`` changes the output as much as a weight.
    Reproducible with ``sha256sum``: the hashed text is
    ``"adapter_config.json <hex>\\nadapter_model.safetensors <hex>\\n"``. The daemon
    computes it at load; a client that received both files computes it again.
    """
    text = f"{ADAPTER_CONFIG_FILE} {config_sha256}\n{ADAPTER_WEIGHTS_FILE} {weights_sha256}\n"
    return format_digest("sha256", hashlib.sha256(text.encode()).hexdigest())
