"""Reading an adapter directory into a verified, immutable in-memory adapter.

Adapters are small (megabytes to a few hundred), so the weights file is read once
into memory and every later slice is cut from those bytes: a file rewritten or
truncated after the load can neither change nor crash what is served, and the
digests computed at load are of exactly the bytes that leave. The directory must
resolve under one of the configured adapter roots; the two files are opened with
``paths.open_confined``, so a link out of the directory is refused too. Pickle
formats (``adapter_model.bin``) are never opened.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import blake3

from weightd.common.digests import format_digest

from ..base.errors import (
    AdapterError,
    AdapterFormatError,
    DigestMismatchError,
    MissingFileError,
    PathEscapeError,
)
from ..base.paths import open_confined
from ..checkpoint.description import Checkpoint
from ..checkpoint.header import header_length, parse_header
from ..checkpoint.scan import read_small
from ..store.runs import RunPattern
from .config import MAX_CONFIG_BYTES, AdapterConfig, parse_adapter_config
from .validate import AdapterModule, verify_adapter

CONFIG_FILE: Final = "adapter_config.json"
WEIGHTS_FILE: Final = "adapter_model.safetensors"
_PICKLES: Final = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
#: Largest adapter weights file accepted (adapters are small; this bounds a mistake).
MAX_ADAPTER_BYTES: Final = 4 << 30


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """A verified adapter: immutable; a replace makes a new one."""

    source: str  # the real path of the adapter directory
    config: AdapterConfig
    modules: tuple[AdapterModule, ...]
    data: bytes  # the whole adapter_model.safetensors, as verified
    tensor_digests: dict[str, str]  # file tensor name -> "blake3:<hex>"
    digest: str  # "sha256:<hex>" over both files, see adapter_digest
    base_model: str = ""  # the served model it was verified against
    config_bytes: int = 0  # adapter_config.json's size: its parsed form is held too

    @property
    def nbytes(self) -> int:
        """What the adapter holds, as the budget counts it: the weights and the config."""
        return len(self.data) + self.config_bytes

    def read(self, pattern: RunPattern) -> bytes:
        """The bytes of ``pattern`` (offsets into the weights file)."""
        view = memoryview(self.data)
        return b"".join(view[off : off + n] for off, n in pattern.ranges())


def adapter_digest(config_sha256: str, weights_sha256: str) -> str:
    """One digest an operator can pin: SHA-256 of both files' SHA-256s, named.

    Covers the config too, since ``lora_alpha`` changes the output as much as a weight.
    Reproducible with ``sha256sum``: the hashed text is
    ``"adapter_config.json <hex>\\nadapter_model.safetensors <hex>\\n"``.
    """
    text = f"{CONFIG_FILE} {config_sha256}\n{WEIGHTS_FILE} {weights_sha256}\n"
    return format_digest("sha256", hashlib.sha256(text.encode()).hexdigest())


def confine_source(source_dir: str, roots: Sequence[str]) -> str:
    """The real path of ``source_dir`` if it lies under one of ``roots``; else raise."""
    if not roots:
        raise PathEscapeError(source_dir, "no adapter roots are configured (--adapter-root)")
    real = os.path.realpath(source_dir)
    for root in roots:
        real_root = os.path.realpath(root)
        if os.path.commonpath([real_root, real]) == real_root and real != real_root:
            if not os.path.isdir(real):
                raise MissingFileError(source_dir, "adapter directory does not exist")
            return real
    raise PathEscapeError(
        source_dir,
        f"resolves to {real}, outside the adapter roots "
        f"{', '.join(os.path.realpath(r) for r in roots)}",
    )


def _read_weights(root: str, reserve: Callable[[int], None] | None) -> bytes:
    """The weights file, whole; ``reserve(size)`` may refuse it (the budget) before the read."""
    path = os.path.join(root, WEIGHTS_FILE)
    if not os.path.lexists(path):
        for pickle in _PICKLES:
            if os.path.lexists(os.path.join(root, pickle)):
                raise AdapterFormatError(
                    os.path.join(root, pickle),
                    f"pickle weights are never loaded; save the adapter as {WEIGHTS_FILE} "
                    "(save_pretrained(..., safe_serialization=True))",
                )
        raise MissingFileError(path, "file does not exist")
    opened = open_confined(root, WEIGHTS_FILE)
    try:
        size = opened.stat.st_size
        if size > MAX_ADAPTER_BYTES:
            raise AdapterError(path, f"{size} bytes, over the {MAX_ADAPTER_BYTES}-byte limit")
        if reserve is not None:
            reserve(size)
        with os.fdopen(opened.fd, "rb", closefd=False) as f:
            data = f.read(size + 1)
    finally:
        os.close(opened.fd)
    if len(data) != size:
        raise AdapterError(path, f"changed while being read ({size} bytes, read {len(data)})")
    return data


def load_adapter(
    source_dir: str,
    roots: Sequence[str],
    base: Checkpoint,
    expected_digest: str | None = None,
    admit: Callable[[int], None] | None = None,
) -> LoadedAdapter:
    """Read, check and digest the adapter in ``source_dir`` for ``base``; raise on any fault.

    ``admit(nbytes)`` is asked, from the files' sizes, before the weights are read: a
    load the budget could never hold is refused without reading it.
    """
    root = confine_source(source_dir, roots)
    raw_config, config_file = read_small(root, CONFIG_FILE, limit=MAX_CONFIG_BYTES)
    config = parse_adapter_config(os.path.join(root, CONFIG_FILE), raw_config)
    config_bytes = len(raw_config)
    del raw_config  # the parsed form is what is kept
    data = _read_weights(root, None if admit is None else lambda n: admit(n + config_bytes))
    path = os.path.join(root, WEIGHTS_FILE)
    length = header_length(path, data[:8], len(data))
    header = parse_header(path, data[8 : 8 + length], len(data))
    modules = verify_adapter(path, header, config, base)
    digests = {
        e.name: format_digest(
            "blake3",
            blake3.blake3(
                memoryview(data)[header.data_start + e.begin : header.data_start + e.end]
            ).hexdigest(),
        )
        for e in header.entries
    }
    digest = adapter_digest(config_file.sha256, hashlib.sha256(data).hexdigest())
    if expected_digest is not None and expected_digest != digest:
        raise DigestMismatchError(root, f"adapter digest: expected {expected_digest}, got {digest}")
    return LoadedAdapter(root, config, modules, data, digests, digest, base.name, config_bytes)
