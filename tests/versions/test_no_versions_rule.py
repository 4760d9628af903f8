"""A daemon built without model versions: both edges refuse a version other than 0 alike.

The side socket used to ignore ``AcquirePack.version`` where gRPC refused it; both now
ask the one ``WeightService``. A daemon from ``weightd serve`` always has versions (that
case is ``test_versions_e2e.py``'s), so this one is assembled in process: a real gRPC
server on a Unix socket with the real client, and the side socket's request handler.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from tests.models import VERSIONED_LLAMA, build_model
from weightd.client import Layout, WeightClient
from weightd.client.base.errors import InvalidArgumentError
from weightd.server.registry.models import ModelRegistry, load_model
from weightd.server.rpc.weights import WeightsService, add_weights_service
from weightd.server.transports.local_service import PackService
from weightd.server.transports.options import LocalConfig
from weightd.server.weights.service import WeightService
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeightService]:
    directory = tmp_path_factory.mktemp("no-versions") / "m"
    build_model("llama", VERSIONED_LLAMA, seed=1).save_pretrained(directory)
    registry = ModelRegistry()
    registry.publish(load_model(str(directory), "m"))
    yield WeightService(registry)  # no ModelVersions: version 0 only
    registry.close()


def acquire(packs: PackService, version: int) -> lpb.LocalResponse:
    request = lpb.AcquirePack(model="m", version=version, layout=pb.Layout(tp_size=1))
    outcome = packs.handle(lpb.LocalRequest(acquire=request))
    if outcome.lease is not None:
        outcome.lease.release()  # the descriptors are the pack's own: the cache closes them
    return outcome.response


def test_both_edges_refuse_a_version_the_same_way(weights: WeightService) -> None:
    with tempfile.TemporaryDirectory(prefix="wd-", dir="/tmp") as tmp:
        path = Path(tmp) / "w.sock"
        server = grpc.server(futures.ThreadPoolExecutor(4))
        add_weights_service(WeightsService(weights), server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        try:
            with WeightClient(f"unix://{path}", timeout=60) as client:
                got = client.fetch_layout(Layout(), model="m", transport="grpc")
                assert got  # version 0: the current one
                with pytest.raises(InvalidArgumentError) as refused:
                    client.fetch_layout(Layout(), model="m", version=3, transport="grpc")
        finally:
            server.stop(None).wait()
    packs = PackService(weights, LocalConfig())
    try:
        assert acquire(packs, 0).WhichOneof("response") == "grant"
        answer = acquire(packs, 3)
    finally:
        packs.close()
    assert answer.WhichOneof("response") == "error"
    assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (answer.error.detail, answer.error.reason) == (
        refused.value.detail,
        refused.value.reason,
    )
    assert "serves no model versions; ask for version 0, not 3" in answer.error.detail
