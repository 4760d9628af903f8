"""The side channel plans whole layouts (pipeline stages, expert ranks) exactly as Fetch does.

Issue #15 item 4: an ``AcquirePack`` with ``pp_size=2, pp_rank=1`` used to be granted
the whole tensor-parallel pack, and ``pp_rank=9`` of 2, ``ep_size=4`` on a dense model
or ``pp_layers=[7,7]`` were granted it too, where gRPC refuses them. Both transports
now take the layout through the same conversion, validation and planner.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon
from weightd.client import InvalidArgumentError, Layout, WeightClient
from weightd.client.transports.local import LocalConnection
from weightd.client.transports.selection import side_socket_path
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(
    transformers_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    models = [("llama", transformers_models["llama"]), ("qwen3", transformers_models["qwen3"])]
    with run_daemon(tmp_path_factory.mktemp("shm-layouts"), models) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(daemon.target, timeout=120) as c:
        yield c


def _acquire(daemon: RunningDaemon, layout: pb.Layout, model: str = "llama") -> lpb.PackGrant:
    path = side_socket_path(daemon.target)
    assert path is not None
    conn = LocalConnection(path, "shm", timeout=60)
    try:
        acquire = lpb.AcquirePack(model=model, layout=layout)
        grant, fds = conn.request(lpb.LocalRequest(acquire=acquire), max_fds=1)
        for fd in fds:
            os.close(fd)
        return grant
    finally:
        conn.close()


def _grpc_names(daemon: RunningDaemon, layout: pb.Layout, model: str = "llama") -> list[str]:
    """The tensor names a gRPC Fetch streams for ``layout``, from its slice headers."""
    with grpc.insecure_channel(daemon.target) as channel:
        fetch = channel.unary_stream(
            "/weightd.v1.Weights/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=pb.FetchResponse.FromString,
        )
        names = []
        for msg in fetch(pb.FetchRequest(model=model, layout=layout), timeout=60):
            names += [c.header.name for c in msg.chunks if c.HasField("header")]
        return names


def _grpc_refusal(daemon: RunningDaemon, layout: pb.Layout, model: str) -> tuple[int, str]:
    with grpc.insecure_channel(daemon.target) as channel:
        fetch = channel.unary_stream(
            "/weightd.v1.Weights/Fetch",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=pb.FetchResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as err:
            list(fetch(pb.FetchRequest(model=model, layout=layout), timeout=60))
        return err.value.code().value[0], err.value.details() or ""


STAGE_LAYOUTS = [
    pb.Layout(tp_size=1, tp_rank=0, pp_size=2, pp_rank=1),
    pb.Layout(tp_size=2, tp_rank=1, pp_size=2, pp_rank=0),
    pb.Layout(tp_size=2, tp_rank=0, pp_size=2, pp_rank=1, pp_layers=[1, 1]),
]


@pytest.mark.parametrize("layout", STAGE_LAYOUTS, ids=lambda x: str(x).replace("\n", " "))
def test_a_pack_holds_exactly_the_stage_fetch_streams(
    daemon: RunningDaemon, layout: pb.Layout
) -> None:
    grant = _acquire(daemon, layout)
    stage = _grpc_names(daemon, layout)
    whole_tp = _grpc_names(daemon, pb.Layout(tp_size=layout.tp_size, tp_rank=layout.tp_rank))
    assert [e.name for e in grant.entries] == stage
    assert len(stage) < len(whole_tp)  # a stage really is less than the TP rank
    # The grant names the layout it was planned for, every field set.
    assert grant.layout.pp_size == layout.pp_size and grant.layout.pp_rank == layout.pp_rank
    assert grant.layout.tp_size == layout.tp_size and grant.layout.tp_rank == layout.tp_rank


@pytest.mark.parametrize(
    "layout",
    [
        pb.Layout(tp_size=1, tp_rank=0, pp_size=2, pp_rank=9),  # rank outside its size
        pb.Layout(tp_size=1, tp_rank=0, ep_size=4, ep_rank=0),  # experts on a dense model
        pb.Layout(tp_size=1, tp_rank=0, pp_size=2, pp_rank=0, pp_layers=[7, 7]),  # != 2 layers
    ],
    ids=["pp_rank-9-of-2", "ep4-dense", "pp_layers-7-7"],
)
def test_layouts_fetch_refuses_are_refused_alike(daemon: RunningDaemon, layout: pb.Layout) -> None:
    code, detail = _grpc_refusal(daemon, layout, "llama")
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    with pytest.raises(InvalidArgumentError) as err:
        _acquire(daemon, layout)
    assert err.value.transport is None  # the request's fault: auto must not fall back
    assert err.value.detail == detail


@pytest.mark.parametrize(
    "layout",
    [
        Layout(tp_size=1, tp_rank=0, pp_size=2, pp_rank=1),
        Layout(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1),
    ],
    ids=["pp1of2", "tp1of2-pp1of2"],
)
@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_fetch_layout_over_shared_memory_equals_grpc(
    client: WeightClient, layout: Layout, model: str
) -> None:
    shm = client.fetch_layout(layout, model=model, transport="shm")
    assert client.last_fetch is not None and client.last_fetch.transport == "shm"
    over_grpc = client.fetch_layout(layout, model=model, transport="grpc")
    assert list(shm) == list(over_grpc)
    for name, t in shm.items():
        g = over_grpc[name]
        assert t.dtype == g.dtype and t.shape == g.shape, name
        assert torch.equal(t.view(torch.uint8), g.view(torch.uint8)), name
    auto = client.fetch_layout(layout, model=model)
    assert client.last_fetch is not None and client.last_fetch.transport == "shm"
    assert list(auto) == list(shm)
