"""Reading an adapter directory into a verified, immutable in-memory adapter.

Adapters are small (megabytes to a few hundred), so the weights file is read once
into memory and every later slice is cut from those bytes: a file rewritten or
truncated after the load can neither change nor crash what is served, and the
digests computed at load are of exactly the bytes that leave. The directory must
lie under one of the configured adapter roots: the root is opened once and the
directory reached from it by descriptor, one component at a time, and both files are
opened relative to the directory's descriptor (:class:`~weightd.server.base.paths.
ConfinedDir`), so swapping the directory for a link out of the root while a load runs
cannot make it read anything outside. Pickle formats (``adapter_model.bin``) are
never opened.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

import blake3

from weightd.common.digests import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    adapter_digest,
    format_digest,
)

from ..base.errors import (
    AdapterError,
    AdapterFormatError,
    DigestMismatchError,
    MissingFileError,
    OutsideRootError,
    PathEscapeError,
    RequestPathError,
    echo,
)
from ..base.paths import ConfinedDir
from ..checkpoint.description import Checkpoint
from ..checkpoint.header import header_length, parse_header
from ..checkpoint.scan import read_small
from ..store.runs import RunPattern
from .config import MAX_CONFIG_BYTES, AdapterConfig, parse_adapter_config
from .validate import AdapterModule, verify_adapter

CONFIG_FILE: Final = ADAPTER_CONFIG_FILE
WEIGHTS_FILE: Final = ADAPTER_WEIGHTS_FILE
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
    #: adapter_config.json exactly as verified (its SHA-256 is in ``digest``): served
    #: whole to engines that read PEFT's own file (vLLM), so nothing is re-derived.
    config_data: bytes = b""
    #: Each file's SHA-256 from the one read (what an OMS signature is compared with).
    file_sha256: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """What the adapter holds, as the budget counts it: the weights and the config
        (counted once though held twice, parsed and as bytes: the parsed form is small)."""
        return len(self.data) + self.config_bytes

    def read(self, pattern: RunPattern) -> bytes:
        """The bytes of ``pattern`` (offsets into the weights file)."""
        view = memoryview(self.data)
        return b"".join(view[off : off + n] for off, n in pattern.ranges())


def _request_parts(source_dir: str) -> None:
    """Refuse a ``source_dir`` that is no plain path (nothing is opened for it)."""
    if "\x00" in source_dir:
        raise RequestPathError(f"source_dir {echo(source_dir)} contains a NUL byte")
    if ".." in source_dir.split("/"):
        raise RequestPathError(
            f"source_dir {echo(source_dir)} has a '..' component; name the adapter directory "
            "under an adapter root without one"
        )


def _under(source_dir: str, roots: Sequence[str]) -> list[tuple[str, str]]:
    """``(root, name below it)`` for each root ``source_dir`` may lie under (by its text).

    An absolute ``source_dir`` must start with a root (as configured or resolved); a
    relative one is tried below each root in turn.
    """
    if not source_dir.startswith("/"):
        return [(root, source_dir) for root in roots]
    found = []
    for root in roots:
        for form in dict.fromkeys((os.path.normpath(root), os.path.realpath(root))):
            if os.path.commonpath([form, os.path.normpath(source_dir)]) == form:
                found.append((root, os.path.relpath(os.path.normpath(source_dir), form)))
    return found


def open_source(source_dir: str, roots: Sequence[str]) -> ConfinedDir:
    """The adapter directory ``source_dir`` names, opened by descriptor under its root.

    Refused: no roots (FAILED_PRECONDITION), a NUL byte or ``..`` (INVALID_ARGUMENT), a
    path outside every root or one whose links lead out (PERMISSION_DENIED).
    """
    if not roots:
        raise PathEscapeError(source_dir, "no adapter roots are configured (--adapter-root)")
    _request_parts(source_dir)
    candidates = _under(source_dir, roots)
    if not candidates:
        raise OutsideRootError(
            source_dir,
            f"is outside the adapter roots {', '.join(os.path.realpath(r) for r in roots)}",
        )
    for root, name in candidates:
        if name == ".":
            raise OutsideRootError(source_dir, "is an adapter root itself, not a directory in it")
        with ConfinedDir.open(root, label="the adapter root", escape=OutsideRootError) as top:
            try:
                return top.subdir(name, label="the adapter directory")
            except MissingFileError:
                continue  # a relative name: perhaps under the next root
    raise MissingFileError(source_dir, "adapter directory does not exist")


def _read_weights(directory: ConfinedDir, reserve: Callable[[int], None] | None) -> bytes:
    """The weights file, whole; ``reserve(size)`` may refuse it (the budget) before the read."""
    path = os.path.join(directory.path, WEIGHTS_FILE)
    if not directory.exists(WEIGHTS_FILE):
        for pickle in _PICKLES:
            if directory.exists(pickle):
                raise AdapterFormatError(
                    os.path.join(directory.path, pickle),
                    f"pickle weights are never loaded; save the adapter as {WEIGHTS_FILE} "
                    "(save_pretrained(..., safe_serialization=True))",
                )
        raise MissingFileError(path, "file does not exist")
    opened = directory.open_file(WEIGHTS_FILE)
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

    Every file is read by descriptor under the adapter root (what is verified is what is
    read). ``admit(nbytes)`` is asked, from the files' sizes, before the weights are read:
    a load the budget could never hold is refused without reading it.
    """
    with open_source(source_dir, roots) as directory:
        root = directory.path
        raw_config, config_file = read_small(directory, CONFIG_FILE, limit=MAX_CONFIG_BYTES)
        config = parse_adapter_config(os.path.join(root, CONFIG_FILE), raw_config)
        config_bytes = len(raw_config)
        data = _read_weights(
            directory, None if admit is None else lambda n: admit(n + config_bytes)
        )
    path = os.path.join(root, WEIGHTS_FILE)
    length = header_length(path, data[:8], len(data))
    header = parse_header(path, data[8 : 8 + length], len(data))
    modules = verify_adapter(path, header, config, base)
    # The two passes (the file's SHA-256, the trusted digest; each tensor's BLAKE3, what
    # packs and streams are checked by) release the GIL: one runs on a second core.
    with ThreadPoolExecutor(1, "weightd-adapter-sha256") as pool:
        whole = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        view = memoryview(data)
        digests = {
            e.name: format_digest(
                "blake3",
                blake3.blake3(
                    view[header.data_start + e.begin : header.data_start + e.end]
                ).hexdigest(),
            )
            for e in header.entries
        }
        weights_sha256 = whole.result()
    digest = adapter_digest(config_file.sha256, weights_sha256)
    if expected_digest is not None and expected_digest != digest:
        raise DigestMismatchError(root, f"adapter digest: expected {expected_digest}, got {digest}")
    return LoadedAdapter(
        root,
        config,
        modules,
        data,
        digests,
        digest,
        base.name,
        config_bytes,
        raw_config,
        {CONFIG_FILE: config_file.sha256, WEIGHTS_FILE: weights_sha256},
    )
