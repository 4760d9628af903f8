"""Trusted manifests: what a checkpoint must hash to, in a form that can be signed. Pure.

A manifest lists every file weightd reads from a checkpoint (``config.json``, the
index, each shard) with its size and SHA-256, and every tensor with its shard,
dtype, shape and BLAKE3 digest::

    {"format": "weightd-manifest", "version": 1, "tensor_digest": "blake3",
     "files":   {"config.json": {"size": 712, "sha256": "9f2c..."}, ...},
     "tensors": {"model.norm.weight": {"file": "model-00002-of-00002.safetensors",
                                       "dtype": "BF16", "shape": [4096],
                                       "digest": "blake3:5d1e..."}, ...},
     "signature": {"algorithm": "ed25519", "key_id": "ed25519:3a7b...", "value": "<base64>"}}

Why two digests: file SHA-256 is what publishers and the Hugging Face hub already
quote (an LFS object id *is* the file's SHA-256), so a manifest can be checked against
them. The per-tensor digest is what the daemon re-checks each time it anchors a
tensor for a layout, so it must be fast: BLAKE3 is cryptographic (collision resistant,
so a trusted digest pins the bytes; xxh3 is not), runs several times faster per core
than SHA-256, and releases the GIL; it is also the digest the daemon
already reports in ``DescribeModel``.

Canonical form (what a signature covers): the manifest object without its
``signature`` member, serialized with keys sorted by code point, no whitespace,
ASCII only (``\\uXXXX`` escapes), integers only (the parser rejects floats, NaN and
duplicate keys, so one parsed manifest has exactly one canonical form), prefixed
with the domain separator ``b"weightd-manifest-v1\\0"`` so a signature over a
manifest can never be replayed as a signature over anything else.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from weightd.common.dtypes import DTYPE_BITS

from ..base.errors import (
    CheckpointError,
    DigestMismatchError,
    ManifestMismatchError,
    ManifestSchemaError,
    ManifestSyntaxError,
    WeightdError,
)
from ..base.paths import check_relative_name
from ..checkpoint.description import Checkpoint, strict_json

FORMAT: Final = "weightd-manifest"
VERSION: Final = 1
TENSOR_DIGEST: Final = "blake3"
SIGNED_CONTEXT: Final = b"weightd-manifest-v1\x00"
#: Largest manifest accepted (about 200 bytes per tensor: 64 MiB holds ~300k tensors).
MAX_MANIFEST_BYTES: Final = 64 << 20
_HEX64: Final = re.compile(r"^[0-9a-f]{64}$")
_JSON_TYPES: Final[dict[type, str]] = {
    dict: "object",
    list: "array",
    str: "string",
    int: "integer",
    bool: "boolean",
    float: "number",
}


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    sha256: str  # lowercase hex


@dataclass(frozen=True, slots=True)
class TensorEntry:
    file: str
    dtype: str
    shape: tuple[int, ...]
    digest: str  # "blake3:<hex>"


@dataclass(frozen=True, slots=True)
class Signature:
    algorithm: str
    key_id: str
    value: str  # base64


@dataclass(frozen=True)
class Manifest:
    path: str
    files: Mapping[str, FileEntry]
    tensors: Mapping[str, TensorEntry]
    signature: Signature | None
    body: Mapping[str, Any]  # the parsed object without "signature": what is signed

    def signed_bytes(self) -> bytes:
        return signed_bytes(self.body)


def canonical_bytes(value: Any) -> bytes:
    """The one serialization of a manifest body (see the module docstring)."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def signed_bytes(body: Mapping[str, Any]) -> bytes:
    return SIGNED_CONTEXT + canonical_bytes(body)


# --- building ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FileDigest:
    """A file's size and SHA-256 as hashed from disk."""

    size: int
    sha256: str


def build_body(
    ckpt: Checkpoint, files: Mapping[str, FileDigest], tensor_digests: Mapping[str, str]
) -> dict[str, Any]:
    """The unsigned manifest of a verified checkpoint."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "tensor_digest": TENSOR_DIGEST,
        "files": {n: {"size": f.size, "sha256": f.sha256} for n, f in sorted(files.items())},
        "tensors": {
            t.name: {
                "file": t.shard,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "digest": tensor_digests[t.name],
            }
            for t in ckpt.tensors.values()
        },
    }


def dumps(document: Mapping[str, Any]) -> str:
    """A manifest as written to disk: sorted and indented, for people and diffs."""
    return json.dumps(document, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


# --- parsing ----------------------------------------------------------------------------


def _field(path: str, obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = "missing" if key not in obj else f"a JSON {_JSON_TYPES.get(type(value), 'value')}"
        raise ManifestSchemaError(
            path, f"field {where}{key!r} must be a JSON {_JSON_TYPES[kind]}, is {got}"
        )
    return value


def _no_floats(path: str, value: Any, where: str) -> None:
    if isinstance(value, float):
        raise ManifestSchemaError(path, f"field {where} is a float; manifests hold integers only")
    if isinstance(value, dict):
        for k, v in value.items():
            _no_floats(path, v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _no_floats(path, v, f"{where}[{i}]")


def parse_manifest(path: str, raw: bytes) -> Manifest:
    """Parse and check a manifest's form. Says nothing about who made it (see signing)."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestSyntaxError(path, f"larger than the {MAX_MANIFEST_BYTES}-byte limit")
    doc = strict_json(path, raw, ManifestSyntaxError)
    _no_floats(path, doc, "")
    if doc.get("format") != FORMAT:
        raise ManifestSchemaError(
            path, f"field 'format' must be {FORMAT!r}, is {doc.get('format')!r}"
        )
    if doc.get("version") != VERSION:
        raise ManifestSchemaError(
            path, f"field 'version' is {doc.get('version')!r}; this weightd reads version {VERSION}"
        )
    if doc.get("tensor_digest") != TENSOR_DIGEST:
        raise ManifestSchemaError(
            path,
            f"field 'tensor_digest' must be {TENSOR_DIGEST!r}, is {doc.get('tensor_digest')!r}",
        )
    known = {"format", "version", "tensor_digest", "files", "tensors", "signature"}
    unknown = sorted(doc.keys() - known)
    if unknown:
        raise ManifestSchemaError(path, f"unknown field {unknown[0]!r}")
    files_raw = _field(path, doc, "files", dict, "")
    files: dict[str, FileEntry] = {}
    root = os.path.dirname(path)
    for name, entry in files_raw.items():
        check_relative_name(root, name, what=f"files[{name!r}]", where=path)
        if not isinstance(entry, dict):
            raise ManifestSchemaError(path, f"field files[{name!r}] must be an object")
        size = _field(path, entry, "size", int, f"files[{name!r}].")
        sha = _field(path, entry, "sha256", str, f"files[{name!r}].")
        if size < 0 or not _HEX64.match(sha) or entry.keys() != {"size", "sha256"}:
            raise ManifestSchemaError(
                path,
                f"field files[{name!r}] must be {{size: n >= 0, sha256: 64 lowercase hex digits}}",
            )
        files[name] = FileEntry(size, sha)
    tensors_raw = _field(path, doc, "tensors", dict, "")
    tensors: dict[str, TensorEntry] = {}
    for name, entry in tensors_raw.items():
        where = f"tensors[{name!r}]."
        if not isinstance(entry, dict):
            raise ManifestSchemaError(path, f"field tensors[{name!r}] must be an object")
        extra = sorted(entry.keys() - {"file", "dtype", "shape", "digest"})
        if extra:
            raise ManifestSchemaError(path, f"field {where}{extra[0]} is unknown")
        file = _field(path, entry, "file", str, where)
        dtype = _field(path, entry, "dtype", str, where)
        shape = _field(path, entry, "shape", list, where)
        digest = _field(path, entry, "digest", str, where)
        if file not in files:
            raise ManifestSchemaError(path, f"field {where}file names {file!r}, not in 'files'")
        if dtype not in DTYPE_BITS:
            raise ManifestSchemaError(
                path, f"field {where}dtype {dtype!r} is not a safetensors dtype"
            )
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ManifestSchemaError(path, f"field {where}shape must be non-negative integers")
        alg, _, hexpart = digest.partition(":")
        if alg != TENSOR_DIGEST or not _HEX64.match(hexpart):
            raise ManifestSchemaError(
                path, f"field {where}digest must be 'blake3:<64 lowercase hex>', is {digest[:80]!r}"
            )
        tensors[name] = TensorEntry(file, dtype, tuple(shape), digest)
    signature = None
    if "signature" in doc:
        sig = doc["signature"]
        if not isinstance(sig, dict) or sig.keys() != {"algorithm", "key_id", "value"}:
            raise ManifestSchemaError(path, "field 'signature' must be {algorithm, key_id, value}")
        signature = Signature(
            _field(path, sig, "algorithm", str, "signature."),
            _field(path, sig, "key_id", str, "signature."),
            _field(path, sig, "value", str, "signature."),
        )
    body = {k: v for k, v in doc.items() if k != "signature"}
    return Manifest(path, files, tensors, signature, body)


# --- comparing --------------------------------------------------------------------------


def compare(
    manifest: Manifest,
    ckpt: Checkpoint,
    files: Mapping[str, FileDigest],
    tensor_digests: Mapping[str, str],
) -> list[WeightdError]:
    """Every way the checkpoint (hashed as ``files`` / ``tensor_digests``) differs."""
    mpath = manifest.path
    problems: list[CheckpointError] = []
    for name in sorted(files.keys() - manifest.files.keys()):
        problems.append(
            ManifestMismatchError(
                os.path.join(ckpt.root, name), f"file {name!r} is not listed in manifest {mpath}"
            )
        )
    for name in sorted(manifest.files.keys() - files.keys()):
        problems.append(
            ManifestMismatchError(
                mpath, f"files[{name!r}] is listed, but the checkpoint does not use that file"
            )
        )
    for name in sorted(files.keys() & manifest.files.keys()):
        got, want = files[name], manifest.files[name]
        where = os.path.join(ckpt.root, name)
        if got.size != want.size:
            problems.append(
                DigestMismatchError(
                    where, f"size is {got.size} bytes, manifest {mpath} says {want.size}"
                )
            )
        elif got.sha256 != want.sha256:
            problems.append(
                DigestMismatchError(
                    where, f"sha256 is {got.sha256}, manifest {mpath} says {want.sha256}"
                )
            )
    for name in sorted(ckpt.tensors.keys() - manifest.tensors.keys()):
        t = ckpt.tensors[name]
        problems.append(
            ManifestMismatchError(
                os.path.join(ckpt.root, t.shard),
                f"tensor {name!r} is not listed in manifest {mpath}",
            )
        )
    for name in sorted(manifest.tensors.keys() - ckpt.tensors.keys()):
        problems.append(
            ManifestMismatchError(mpath, f"tensors[{name!r}] is listed, but no shard has it")
        )
    for t in ckpt.tensors.values():
        want_t = manifest.tensors.get(t.name)
        if want_t is None:
            continue
        where = os.path.join(ckpt.root, t.shard)
        got_t = (t.shard, t.dtype, t.shape)
        if got_t != (want_t.file, want_t.dtype, want_t.shape):
            problems.append(
                ManifestMismatchError(
                    where,
                    f"tensor {t.name!r} is {t.dtype} {list(t.shape)} in {t.shard}; manifest "
                    f"{mpath} says {want_t.dtype} {list(want_t.shape)} in {want_t.file}",
                )
            )
        elif tensor_digests.get(t.name) != want_t.digest:
            problems.append(
                DigestMismatchError(
                    where,
                    f"tensor {t.name!r}: digest {tensor_digests.get(t.name)}, manifest "
                    f"{mpath} says {want_t.digest}",
                )
            )
    return list(problems)
