"""End to end: layouts that cannot work are refused before a byte moves, with code and detail.

Each case goes through the real daemon; the client raises the class for the gRPC
status and carries the daemon's detail, which names the tensor or field and sizes.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.conftest import RunningDaemon
from weightd.client import InvalidArgumentError, Layout, WeightClient
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(layout_daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(layout_daemon.target, timeout=120) as c:
        yield c


Q = "model.layers.0.self_attn.q_proj.weight"
CASES = [
    pytest.param(
        "llama",
        Layout(tp_size=3),
        [Q],
        ("q_proj.weight", "num_attention_heads=8", "not divisible", "world_size 3"),
        id="heads-not-divisible",
    ),
    pytest.param(
        "llama",
        Layout(tp_size=3),
        [],
        ("embed_tokens.weight", "dim 0 of size 128", "world_size 3"),
        id="first-tensor-that-cannot-be-cut",
    ),
    pytest.param(
        "phi3",
        Layout(tp_size=16),
        ["model.layers.1.self_attn.qkv_proj.weight"],
        ("qkv_proj", "num_attention_heads=8", "world_size 16"),
        id="fused-qkv-heads-not-divisible",
    ),
    pytest.param(
        "llama",
        Layout(pp_size=2, pp_layers=(1, 1)),
        [],
        ("pp_layers [1, 1] sums to 2 layers", "num_hidden_layers=3"),
        id="stage-layers-do-not-sum",
    ),
    pytest.param(
        "llama",
        Layout(pp_size=4),
        [],
        ("pp_size 4 exceeds num_hidden_layers=3",),
        id="more-stages-than-layers",
    ),
    pytest.param(
        "mixtral",
        Layout(ep_size=3, ep_rank=2),
        [],
        ("num_experts=4", "not divisible by ep_size 3"),
        id="experts-not-divisible-by-ep",
    ),
    pytest.param(
        "qwen3-moe",
        Layout(ep_size=8, ep_rank=7),
        [],
        ("num_experts=4", "ep_size 8"),
        id="more-ep-ranks-than-experts",
    ),
    pytest.param(
        "llama",
        Layout(ep_size=2),
        [],
        ("has no experts", "ep_size must be 1"),
        id="ep-on-a-dense-model",
    ),
]


@pytest.mark.parametrize(("model", "layout", "names", "needles"), CASES)
def test_layout_rejected_with_invalid_argument(
    client: WeightClient, model: str, layout: Layout, names: list[str], needles: tuple[str, ...]
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        client.fetch_layout(layout, model=model, names=names)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    for needle in needles:
        assert needle in err.value.detail, (needle, err.value.detail)


def test_tensor_of_another_stage_or_expert_by_name(client: WeightClient) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        client.fetch_layout(
            Layout(pp_size=2, pp_rank=0), model="llama", names=["model.layers.2.mlp.up_proj.weight"]
        )
    assert "belongs to pipeline stage 1 (layer 2)" in err.value.detail
    with pytest.raises(InvalidArgumentError) as err:
        client.fetch_layout(
            Layout(ep_size=2, ep_rank=0),
            model="mixtral",
            names=["model.layers.1.block_sparse_moe.experts.3.w2.weight"],
        )
    assert "expert 3 belongs to ep rank 1" in err.value.detail
    got = client.fetch_layout(
        Layout(ep_size=2, ep_rank=1),
        model="mixtral",
        names=["model.layers.1.block_sparse_moe.experts.3.w2.weight"],
    )
    assert list(got) == ["model.layers.1.block_sparse_moe.experts.3.w2.weight"]


@pytest.mark.parametrize(
    ("layout", "needle"),
    [
        (pb.Layout(tp_size=1, pp_size=2, pp_rank=2), "pp_rank 2 is outside pp_size 2"),
        (pb.Layout(tp_size=1, ep_size=2, ep_rank=5), "ep_rank 5 is outside ep_size 2"),
        (pb.Layout(tp_size=1, ep_size=5000), "ep_size 5000 is invalid"),
        (
            pb.Layout(tp_size=1, pp_size=2, pp_layers=[3]),
            "pp_layers lists 1 stages but pp_size is 2",
        ),
    ],
)
def test_layout_fields_checked_by_the_daemon(
    layout_daemon: RunningDaemon, layout: pb.Layout, needle: str
) -> None:
    """The daemon itself refuses bad layout fields (not only the client)."""
    with grpc.insecure_channel(layout_daemon.target) as channel:
        stub = pb_grpc.WeightsStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Fetch(pb.FetchRequest(model="mixtral", layout=layout), timeout=60))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()


def test_old_clients_unset_fields_mean_tensor_parallel_only(layout_daemon: RunningDaemon) -> None:
    with grpc.insecure_channel(layout_daemon.target) as channel:
        stub = pb_grpc.WeightsStub(channel)
        replies = list(
            stub.Fetch(
                pb.FetchRequest(model="mixtral", layout=pb.Layout(tp_size=2, tp_rank=1)), timeout=60
            )
        )
    assert replies[-1].done.num_tensors == 60
