"""The fuzz targets: each feeds bytes to one parser and lets only typed errors out.

A target returns normally for an input the parser accepts or refuses with a
:class:`~weightd.server.base.errors.WeightdError` subclass whose message names the file
(the contract every caller relies on: a precise one-line error, a precise gRPC
code). Anything else escaping — KeyError, TypeError, RecursionError, OverflowError,
re.error, an error that does not name its file — is a crasher.

Seeds (``fuzz_seeds/<target>/``) are real files: shards and an index written by
``transformers``, a manifest (and a signed one) written by ``weightd manifest``,
``adapter_config.json`` files written by PEFT. ``python -m tests.reliability.fuzz
--make-seeds DIR`` regenerates them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from weightd.server.adapters.config import parse_adapter_config
from weightd.server.base.errors import WeightdError
from weightd.server.checkpoint.description import INDEX_FILE, parse_index
from weightd.server.checkpoint.header import header_length, parse_header
from weightd.server.trust.manifest import parse_manifest
from weightd.server.trust.signing import check_signature, load_public_key

HERE: Final = Path(__file__).resolve().parent
SEEDS: Final = HERE / "fuzz_seeds"
REGRESSIONS: Final = HERE / "fuzz_regressions"
ROOT: Final = "/fuzz/model"
#: Module names an adapter's patterns are matched against (as loading does).
MODULES: Final = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.1.mlp.down_proj",
    "lm_head",
)


class Crash(AssertionError):
    """A typed error that does not name its file: as bad as an untyped one."""


def _typed(exc: WeightdError, path: str) -> None:
    if os.path.basename(path) not in str(exc):
        raise Crash(f"{type(exc).__name__} does not name {path}: {exc}") from exc


def header(data: bytes) -> None:
    path = f"{ROOT}/model-00001-of-00002.safetensors"
    try:
        n = header_length(path, data[:8], len(data))
        parse_header(path, data[8 : 8 + n], len(data))
    except WeightdError as exc:
        _typed(exc, path)


def index(data: bytes) -> None:
    try:
        parse_index(ROOT, data)
    except WeightdError as exc:
        _typed(exc, INDEX_FILE)


def manifest(data: bytes) -> None:
    path = f"{ROOT}/weightd-manifest.json"
    try:
        parse_manifest(path, data)
    except WeightdError as exc:
        _typed(exc, path)


_KEY: list[object] = []


def signature(data: bytes) -> None:
    """The signature envelope: a manifest parsed, then its signature checked."""
    if not _KEY:
        _KEY.append(load_public_key(str(SEEDS / "signature.pub")))
    path = f"{ROOT}/weightd-manifest.json"
    try:
        check_signature(parse_manifest(path, data), [_KEY[0]])  # type: ignore[list-item]
    except WeightdError as exc:
        _typed(exc, path)


def adapter_config(data: bytes) -> None:
    """Parse ``adapter_config.json`` and use it as a load does (targets, ranks, scales)."""
    path = "/fuzz/adapter/adapter_config.json"
    try:
        config = parse_adapter_config(path, data)
    except WeightdError as exc:
        _typed(exc, path)
        return
    for module in MODULES:
        if config.targets(module):
            config.scaling_for(module)
        config.rank_for(module)
        config.alpha_for(module)


TARGETS: Final[dict[str, Callable[[bytes], None]]] = {
    "header": header,
    "index": index,
    "manifest": manifest,
    "signature": signature,
    "adapter_config": adapter_config,
}


def seeds(target: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((SEEDS / target).iterdir())]


def regressions(target: str) -> list[Path]:
    folder = REGRESSIONS / target
    return sorted(folder.iterdir()) if folder.is_dir() else []
