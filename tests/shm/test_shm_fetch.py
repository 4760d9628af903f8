"""Shared-memory fetches against a daemon out of process: same bytes as gRPC, and more."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon
from tests.models import CONFIGS
from weightd.client import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PackRef,
    WeightClient,
    WeightdError,
)
from weightd.client.transports.local import LocalConnection, local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(
    transformers_models: dict[str, Path],
    big_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningDaemon]:
    models = [*sorted(transformers_models.items()), ("big", big_model)]
    with run_daemon(tmp_path_factory.mktemp("shm-daemon"), models) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(daemon.target, timeout=120) as c:
        yield c


def side(daemon: RunningDaemon) -> str:
    path = side_socket_path(daemon.target)
    assert path is not None
    return path


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name, x in a.items():
        y = b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


@pytest.mark.parametrize("model", [*CONFIGS, "big"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shm_equals_grpc_bit_for_bit(client: WeightClient, model: str, world_size: int) -> None:
    for rank in range(world_size):
        shm, shm_info = client.fetch_with_info(rank, world_size, model=model, transport="shm")
        grpc_state, grpc_info = client.fetch_with_info(
            rank, world_size, model=model, transport="grpc"
        )
        assert (shm_info.transport, grpc_info.transport) == ("shm", "grpc")
        assert shm_info.pack is not None and not shm_info.copied
        assert_same(shm, grpc_state)
        auto, auto_info = client.fetch_with_info(rank, world_size, model=model)
        assert auto_info.transport == "shm" and auto_info.fallbacks == ()
        assert auto_info.pack is not None and auto_info.pack.pack_id == shm_info.pack.pack_id
        assert_same(auto, shm)


def test_names_select_entries_in_the_order_asked(client: WeightClient) -> None:
    names = ["model.norm.weight", "model.layers.1.mlp.down_proj.weight"]
    got = client.fetch(1, 2, model="llama", names=names, transport="shm")
    assert list(got) == names
    assert_same(got, client.fetch(1, 2, model="llama", names=names, transport="grpc"))


def test_copy_and_verify(client: WeightClient) -> None:
    shared = client.fetch(0, 2, model="big", transport="shm", verify=True)
    private, info = client.fetch_with_info(0, 2, model="big", transport="shm", copy=True)
    assert info.copied
    assert_same(shared, private)
    name = "model.layers.0.mlp.up_proj.weight"
    assert shared[name].data_ptr() != private[name].data_ptr()
    again = client.fetch(0, 2, model="big", transport="shm")
    assert again[name].data_ptr() != shared[name].data_ptr()  # each fetch maps anew ...
    assert torch.equal(again[name], shared[name])  # ... the same pages


def test_in_place_writes_stay_private_to_the_writer(client: WeightClient) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    mine = client.fetch(0, 2, model="big", transport="shm")
    original = mine[name].clone()
    mine[name].zero_()  # copy-on-write: no crash, and nobody else sees it
    assert not torch.any(mine[name])
    theirs = client.fetch(0, 2, model="big", transport="shm")
    assert torch.equal(theirs[name], original)


def test_pack_descriptor_is_sealed(daemon: RunningDaemon) -> None:
    conn = LocalConnection(side(daemon), "shm", timeout=60)
    try:
        acquire = lpb.AcquirePack(model="llama", layout=pb.Layout(tp_size=2, tp_rank=0))
        grant, fds = conn.request(lpb.LocalRequest(acquire=acquire), max_fds=1)
        (fd,) = fds
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            for seal in (fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW, fcntl.F_SEAL_WRITE):
                assert seals & seal
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1)
            assert os.fstat(fd).st_size == grant.size_bytes
            assert all(e.offset % 256 == 0 for e in grant.entries)
            assert all(e.digest.startswith("sha256:") for e in grant.entries)
        finally:
            os.close(fd)
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (dict(rank=0, world_size=1, model="no-such-model"), NotFoundError),
        (dict(rank=0, world_size=1), InvalidArgumentError),  # several models: name one
        (dict(rank=0, world_size=2, model="llama", names=["model.nope"]), NotFoundError),
        (dict(rank=0, world_size=3, model="llama"), InvalidArgumentError),
        (dict(rank=0, world_size=2, model="unknown-arch"), FailedPreconditionError),
        (
            dict(rank=0, world_size=2, model="llama", names=["model.norm.weight"] * 2),
            InvalidArgumentError,
        ),
    ],
)
def test_errors_are_the_same_over_both_transports(
    client: WeightClient, kwargs: dict[str, object], error: type[WeightdError]
) -> None:
    seen = []
    for transport in ("grpc", "shm", "auto"):
        with pytest.raises(error) as err:
            client.fetch(**kwargs, transport=transport)  # type: ignore[arg-type]
        assert err.value.transport is None  # the request's fault, not the transport's
        seen.append((err.value.code, err.value.detail))
    assert seen[0] == seen[1] == seen[2]


def test_bad_transport_arguments(client: WeightClient) -> None:
    with pytest.raises(InvalidArgumentError, match="needs a CUDA device"):
        client.fetch(0, 1, model="llama", transport="cuda_ipc")
    with pytest.raises(InvalidArgumentError, match="not one of"):
        client.fetch(0, 1, model="llama", transport="pigeon")  # type: ignore[arg-type]


def test_cuda_placement_is_refused_as_a_transport_failure(daemon: RunningDaemon) -> None:
    """This daemon runs without --cuda-ipc: a CUDA request fails as the transport's fault."""
    conn = LocalConnection(side(daemon), "cuda_ipc", timeout=60)
    try:
        assert list(conn.hello.placements) == [lpb.PLACEMENT_HOST]
        acquire = lpb.AcquirePack(
            model="llama",
            layout=pb.Layout(tp_size=1, tp_rank=0),
            placement=lpb.PLACEMENT_CUDA,
            gpu_uuid="00000000-0000-0000-0000-000000000000",
        )
        with pytest.raises(FailedPreconditionError) as err:
            conn.request(lpb.LocalRequest(acquire=acquire))
        assert err.value.transport == "cuda_ipc"
        assert "started without --cuda-ipc" in err.value.detail
    finally:
        conn.close()


def test_concurrent_first_requests_build_one_pack(daemon: RunningDaemon) -> None:
    before = local_stats(side(daemon)).builds_total
    results: list[tuple[int, bool]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def fetch() -> None:
        try:
            with WeightClient(daemon.target, timeout=120) as c:
                start.wait()
                state, info = c.fetch_with_info(3, 4, model="big", transport="shm", copy=True)
                assert info.pack is not None and state
                results.append((info.pack.pack_id, info.pack.built))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len({pack_id for pack_id, _ in results}) == 1
    assert sum(built for _, built in results) <= 1
    after = local_stats(side(daemon)).builds_total
    assert after - before <= 1  # zero if an earlier test already built rank 3 of 4


def test_attach_shares_the_pack_and_refuses_other_boots(client: WeightClient) -> None:
    state, info = client.fetch_with_info(1, 2, model="qwen3", transport="shm")
    assert info.pack is not None
    attached, attach_info = client.attach(info.pack)
    assert attach_info.pack is not None
    assert attach_info.pack.pack_id == info.pack.pack_id and not attach_info.pack.built
    assert_same(attached, state)
    stale = PackRef(**{**info.pack.__dict__, "boot_id": "0" * 32})
    with pytest.raises(FailedPreconditionError) as err:
        client.attach(stale)
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "0" * 32 in err.value.detail and "restarted" in err.value.detail
