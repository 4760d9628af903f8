"""Is the daemon's model the checkpoint in vLLM's model directory? Decided before loading.

vLLM builds the model from ``DIR/config.json`` and would then take the weights from
weightd: if the two are different checkpoints the engine could run with weights that
merely happen to fit the shapes. The commonest mix-up in a fleet is the hardest to see:
a fine-tune of the same base has the same ``config.json``, the same index and the same
shard sizes, only other numbers. So the loader compares what the daemon verified
(``DescribeModel.files``) with ``DIR`` without reading the checkpoint:

* every JSON file the daemon lists (config.json, the index, ...) that ``DIR`` has must
  have the same SHA-256, and ``DIR/config.json`` must exist;
* every shard present in ``DIR`` must have the daemon's size, and then is proven, by
  the first way that applies:

  1. **same file**: the daemon is on this host (same boot id) and holds open the very
     file (device, inode, size, mtime) that ``DIR`` names;
  2. **cache blob**: ``DIR``'s shard links to a Hugging Face cache blob named by its
     SHA-256, and the daemon hashed the whole file to that same value;
  3. **sampled**: a few KiB of every tensor (``weightd.common.sampling``, ~8 KiB per
     tensor) hash to the daemon's sampled digest of its verified file;

  a shard for which the daemon sends none of these (a daemon that predates them) is
  *unchecked*: refused, unless the operator opted out (``identity: "warn"``), and then
  named in a WARNING;
* a ``.safetensors`` file in ``DIR`` that the daemon does not serve is a difference.

A directory holding only the config and tokenizer is accepted: the weights then exist
only in the daemon, and there is nothing to compare them with.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from weightd.client import FileDigest, ModelDescription
from weightd.common.sampling import header_tensors, sample_digest

#: A JSON file larger than this in DIR is not read (config and index files are small).
MAX_SMALL_FILE = 64 << 20
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Difference:
    """One way ``DIR`` and the served model differ, both sides named."""

    file: str
    here: str
    served: str

    def __str__(self) -> str:
        return f"{self.file}: {self.here} in the model directory, {self.served} in the daemon"


@dataclass
class Comparison:
    """What :func:`compare_files` found: differences, and how each shard was proven."""

    differences: list[Difference] = field(default_factory=list)
    #: shard -> "same file", "cache blob" or "sampled"
    proven: dict[str, str] = field(default_factory=dict)
    #: shards nothing could prove, and why
    unchecked: dict[str, str] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size > MAX_SMALL_FILE:
            return f"(over {MAX_SMALL_FILE} bytes)"
        return hashlib.sha256(f.read()).hexdigest()


def _short(digest: str) -> str:
    return f"sha256 {digest[:16]}" if digest else "no sha256"


def boot_id(path: str = BOOT_ID_PATH) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""


def local_sample(path: Path) -> str:
    """The sampled digest of the local file at ``path`` (``weightd.common.sampling``)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size

        def read(offset: int, n: int) -> bytes:
            data = os.pread(fd, n, offset)
            if len(data) != n:
                raise ValueError(f"short read at {offset}: {len(data)} of {n} bytes")
            return data

        return sample_digest(header_tensors(read, size), read)
    finally:
        os.close(fd)


def _prove(local: Path, f: FileDigest, here_boot: str, served_boot: str) -> tuple[str, str, str]:
    """``("proven", how, "")``, ``("differs", here, served)`` or ``("unchecked", why, "")``."""
    st = local.stat()
    held = (f.device, f.inode, f.size, f.mtime_ns)
    same_host = bool(f.inode and served_boot) and served_boot == here_boot
    if same_host and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == held:
        return "proven", "same file", ""
    if f.sha256 and local.is_symlink():
        blob = os.path.basename(os.readlink(local))
        if _SHA256_NAME.fullmatch(blob):
            if blob != f.sha256:
                return "differs", f"cache blob sha256 {blob[:16]}", f"sha256 {f.sha256[:16]}"
            return "proven", "cache blob", ""
    if f.sample_digest:
        try:
            mine = local_sample(local)
        except (OSError, ValueError) as exc:
            return "differs", f"not a readable safetensors file ({exc})", "a verified shard"
        if mine != f.sample_digest:
            return "differs", f"sampled tensor bytes hash to {mine}", f.sample_digest
        return "proven", "sampled", ""
    return "unchecked", "the daemon sent no file identity, blob digest or sample for it", ""


def compare_files(directory: Path, description: ModelDescription) -> Comparison:
    """Every difference between ``directory`` and the served model, and how it was proven."""
    files: Sequence[FileDigest] = description.files
    if not files:  # an older daemon: its config.json, verbatim
        files = (
            FileDigest(
                "config.json",
                len(description.config_json.encode()),
                hashlib.sha256(description.config_json.encode()).hexdigest(),
            ),
        )
    out = Comparison()
    served = {f.name: f for f in files}
    if not (directory / "config.json").is_file():
        out.differences.append(Difference("config.json", "missing", "present"))
    here_boot = boot_id()
    for f in files:
        local = directory / f.name
        if not local.is_file():
            continue
        if f.name.endswith(".json"):
            mine = _sha256(local)
            if f.sha256 and mine != f.sha256:
                out.differences.append(Difference(f.name, _short(mine), _short(f.sha256)))
            continue
        size = local.stat().st_size
        if size != f.size:
            out.differences.append(Difference(f.name, f"{size} bytes", f"{f.size} bytes"))
            continue
        verdict, detail, theirs = _prove(local, f, here_boot, description.host_boot_id)
        if verdict == "proven":
            out.proven[f.name] = detail
        elif verdict == "differs":
            out.differences.append(Difference(f.name, detail, theirs))
        else:
            out.unchecked[f.name] = detail
    if description.files:
        for local in sorted(directory.glob("*.safetensors")):
            if local.name not in served:
                out.differences.append(Difference(local.name, "present", "not served"))
    return out


def compare(directory: Path, description: ModelDescription) -> list[Difference]:
    """Every difference between ``directory`` and the served model; empty: the same one."""
    return compare_files(directory, description).differences
