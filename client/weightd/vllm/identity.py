"""Is the daemon's model the checkpoint in vLLM's model directory? Decided before loading.

vLLM builds the model from ``DIR/config.json`` and would then take the weights from
weightd: if the two are different checkpoints the engine could run with weights that
merely happen to fit the shapes. So the loader compares what the daemon verified
(``DescribeModel.files``: config.json and the index with their SHA-256, every shard's
size) with ``DIR``:

* every JSON file the daemon lists (config.json, the index, ...) that ``DIR`` has must
  have the same SHA-256, and ``DIR/config.json`` must exist;
* every shard present in ``DIR`` must have the daemon's size (a directory holding only
  the config and tokenizer is accepted: the weights then exist only in the daemon);
* a ``.safetensors`` file in ``DIR`` that the daemon does not serve is a difference.

A daemon that predates ``files`` is compared on ``config.json`` alone (its
``config_json`` is verbatim). Only small files are hashed here; shards are compared
by size, because hashing them would read the whole checkpoint the loader exists to
avoid reading.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from weightd.client import FileDigest, ModelDescription

#: A JSON file larger than this in DIR is not read (config and index files are small).
MAX_SMALL_FILE = 64 << 20


@dataclass(frozen=True)
class Difference:
    """One way ``DIR`` and the served model differ, both sides named."""

    file: str
    here: str
    served: str

    def __str__(self) -> str:
        return f"{self.file}: {self.here} in the model directory, {self.served} in the daemon"


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size > MAX_SMALL_FILE:
            return f"(over {MAX_SMALL_FILE} bytes)"
        return hashlib.sha256(f.read()).hexdigest()


def _short(digest: str) -> str:
    return f"sha256 {digest[:16]}" if digest else "no sha256"


def compare(directory: Path, description: ModelDescription) -> list[Difference]:
    """Every difference between ``directory`` and the served model; empty: the same one."""
    files: Sequence[FileDigest] = description.files
    if not files:  # an older daemon: its config.json, verbatim
        files = (
            FileDigest(
                "config.json",
                len(description.config_json.encode()),
                hashlib.sha256(description.config_json.encode()).hexdigest(),
            ),
        )
    out: list[Difference] = []
    served = {f.name: f for f in files}
    if not (directory / "config.json").is_file():
        out.append(Difference("config.json", "missing", "present"))
    for f in files:
        local = directory / f.name
        if not local.is_file():
            continue
        if f.name.endswith(".json"):
            mine = _sha256(local)
            if f.sha256 and mine != f.sha256:
                out.append(Difference(f.name, _short(mine), _short(f.sha256)))
            continue
        size = local.stat().st_size
        if size != f.size:
            out.append(Difference(f.name, f"{size} bytes", f"{f.size} bytes"))
    if description.files:
        for local in sorted(directory.glob("*.safetensors")):
            if local.name not in served:
                out.append(Difference(local.name, "present", "not served"))
    return out
