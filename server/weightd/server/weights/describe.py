"""A model's description at a version: the one answer both wires give.

The gRPC ``DescribeModel`` and the side channel's ``LocalRequest.describe`` (a worker
on the daemon's host holding its whole conversation without a gRPC channel) answer
with the same ``ModelDescription`` message, built here from the model
:meth:`~.service.WeightService.model` resolves: one rule for a version, one list of
held files and digests, whichever wire asked. The message type is the wire contract's,
so this is the one place below the edges that names it.
"""

from __future__ import annotations

from weightd.v1 import weightd_pb2 as pb

from .service import WeightService


def describe_model(weights: WeightService, name: str, version: int) -> pb.ModelDescription:
    """``name`` (empty: the only model) at ``version`` (0: the current one): every
    tensor with its verified digest, and every file the load verified (for a client's
    identity check of its local copy)."""
    m = weights.model(name, version)
    ckpt = m.checkpoint
    out = pb.ModelDescription(
        name=ckpt.name,
        architecture=ckpt.architecture,
        config_json=ckpt.config_json,
        total_bytes=ckpt.total_bytes,
        model_fingerprint=m.fingerprint,
        version=m.version,
        trust_root=m.trust_root,
        host_boot_id=weights.boot_id(),
    )
    for f in weights.held_files(m):
        entry = out.files.add(name=f.name, size=f.size, sha256=f.sha256)
        if f.shard:
            entry.device, entry.inode, entry.mtime_ns = f.device, f.inode, f.mtime_ns
            entry.sample_digest = f.sample_digest
    for t in ckpt.tensors.values():
        out.tensors.add(
            name=t.name,
            dtype=t.dtype,
            shape=t.shape,
            shard=t.shard,
            nbytes=t.nbytes,
            digest=m.tensor_digests[t.name],
        )
    return out
