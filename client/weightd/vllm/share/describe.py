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

from weightd.client import ModelDescription, WeightClient, WeightdError
from weightd.client.api.descriptions import description_of
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
    """The client's :class:`ModelDescription` of a side-socket answer: the same fields
    read the same way as gRPC's (one reader)."""
    return description_of(d)
