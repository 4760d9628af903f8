"""What the daemon says about its models (ListModels, DescribeModel), as plain values.

Separate from ``client`` so that code handling descriptions (tools, tests) does not
need the connection class, and the connection class stays about connections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightd.v1 import weightd_pb2 as pb

    from ..transports.local_describe import WireDescription


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    total_bytes: int
    num_tensors: int
    ready: bool
    #: "loading", "ready", "stale" (still serving its verified files, replaced on disk)
    #: or "broken"; "" from a daemon that predates the field.
    state: str = ""
    reason: str = ""  # why, when not ready: names the file and what changed
    #: The current version number (0 from a daemon that predates versions, or loading).
    version: int = 0
    #: Which trust root proved the served version (``ModelDescription.trust_root``).
    trust_root: str = ""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    nbytes: int
    digest: str


@dataclass(frozen=True)
class FileDigest:
    """A file the daemon read from the model directory, as verified."""

    name: str  # relative to the model directory
    size: int
    sha256: str  # lowercase hex; "" when the daemon did not hash the whole file
    #: The file the daemon holds open (0 from daemons that predate the fields): on the
    #: same host (``ModelDescription.host_boot_id``) equal values mean the same file.
    device: int = 0
    inode: int = 0
    mtime_ns: int = 0
    #: A shard's sampled digest (``weightd.common.sampling``); "" when not sent.
    sample_digest: str = ""


@dataclass(frozen=True)
class ModelDescription:
    name: str
    architecture: str
    config_json: str
    total_bytes: int
    tensors: tuple[TensorInfo, ...]
    #: config.json and the index (always hashed) and every shard; empty from a daemon
    #: that predates the field. Lets a client prove a local copy is the served one.
    files: tuple[FileDigest, ...] = ()
    #: Identity of the served content (config and every verified tensor digest).
    model_fingerprint: str = ""
    #: The daemon host's boot id ("" when not sent).
    host_boot_id: str = ""
    #: The version described (0 from a daemon that predates versions).
    version: int = 0
    #: Which trust root proved this version before it was served: "oms-key:sha256:...",
    #: "oms-certificate:SUBJECT", "manifest:ed25519:...", "manifest-unsigned",
    #: "hf-cache", "object-store"; "" when only the digests computed at load vouch for
    #: it (or the daemon predates the field).
    trust_root: str = ""


def model_info_of(m: pb.ModelSummary) -> ModelInfo:
    return ModelInfo(
        m.name,
        m.architecture,
        m.total_bytes,
        m.num_tensors,
        m.ready,
        m.state,
        m.reason,
        m.version,
        m.trust_root,
    )


def description_of(d: pb.ModelDescription | WireDescription) -> ModelDescription:
    """The plain value of a description, from gRPC's message or from the side socket's
    (the same fields, decoded without protobuf so a same-host load imports none)."""
    return ModelDescription(
        d.name,
        d.architecture,
        d.config_json,
        d.total_bytes,
        tuple(
            TensorInfo(t.name, t.dtype, tuple(t.shape), t.shard, t.nbytes, t.digest)
            for t in d.tensors
        ),
        tuple(
            FileDigest(f.name, f.size, f.sha256, f.device, f.inode, f.mtime_ns, f.sample_digest)
            for f in d.files
        ),
        d.model_fingerprint,
        d.host_boot_id,
        d.version,
        d.trust_root,
    )
