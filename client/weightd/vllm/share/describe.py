"""The daemon's description of a model, asked over the side socket on the daemon's host.

A worker's conversation with the daemon is: describe the model, prove the local copy
is that checkpoint (``identity``), fetch its share (``fetch``). On the daemon's host
the fetch maps a sealed pack received over the side socket; the describe goes there
too (``LocalRequest.describe``), so the load opens no gRPC channel and imports no gRPC
module at all (a test proves it in a fresh process). The answer is the gRPC
``DescribeModel``'s message from the daemon's same code: the same version rule, the
same refusals, the same typed errors.

gRPC describes instead where there is no side socket (another host, a TCP target),
where the worker insists on ``transport="grpc"``, where the daemon predates the request
(it refuses it as a request it does not know), and, with a WARNING, where the side
channel itself fails: the same behaviour as before.
"""

from __future__ import annotations

import logging
import os

from weightd.client import FileDigest, ModelDescription, TensorInfo, WeightClient, WeightdError
from weightd.client.transports.local_describe import (
    WireDescription,
    describe_local,
    is_not_understood,
)
from weightd.client.transports.selection import side_socket_path

log = logging.getLogger("vllm.weightd")


def describe(
    client: WeightClient,
    model: str | None,
    *,
    version: int = 0,
    transport: str = "auto",
) -> tuple[ModelDescription, str]:
    """``model`` (None: the daemon's only one) at ``version`` (0: the current one), and
    the wire that described it: ``"shm"`` (the side socket) or ``"grpc"``."""
    side = side_socket_path(client.target)
    if transport != "grpc" and side is not None and os.path.exists(side):
        try:
            wire = describe_local(side, model or "", version, timeout=client.timeout)
            return description_of_wire(wire), "shm"
        except WeightdError as exc:
            if is_not_understood(exc):
                log.debug("weightd: the daemon predates describing on %s: over gRPC", side)
            elif exc.transport is not None:
                log.warning(
                    "weightd: describing over the side socket %s failed, over gRPC instead: %s",
                    side,
                    exc,
                )
            else:
                raise  # the daemon's answer (unknown model, version not held): gRPC's too
    return client.describe(model, version=version), "grpc"


def description_of_wire(d: WireDescription) -> ModelDescription:
    """The client's :class:`ModelDescription` of a side-socket answer (the same fields
    as ``weightd.client.api.descriptions.description_of`` reads from gRPC's)."""
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
