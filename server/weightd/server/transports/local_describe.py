"""The side channel's describe: a worker on the daemon's host asks what it will load.

A vLLM worker describes the model (its tensors, the files the daemon verified, the
version and trust root), proves its model directory is that checkpoint, then maps its
rank's pack. Over gRPC the first step alone opened a channel and an HTTP/2 connection
that a plain file read never pays; here it is one more exchange on the Unix socket the
fetch uses anyway. The answer is the gRPC ``DescribeModel``'s message, built by the
same door (:func:`~weightd.server.weights.describe.describe_model`): the same model at
the same version, the same refusals (unknown model, a version not held), with the
request bounded as every side-channel request is (``check_fields`` and the request
frame limit, before it gets here).
"""

from __future__ import annotations

from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

from ..weights.describe import describe_model
from ..weights.service import WeightService
from .grants import Outcome


def describe(weights: WeightService, request: pb.DescribeModelRequest) -> Outcome:
    """The description ``request`` asks for; no lease (the connection ends after it)."""
    description = describe_model(weights, request.model, request.version)
    return Outcome(lpb.LocalResponse(description=description), [])
