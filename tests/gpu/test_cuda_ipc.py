"""CUDA IPC and pinned staging against a real daemon (marker ``gpu``).

These skip where there is no usable CUDA (torch and the driver API both) and are
real tests elsewhere. **They have never run:** weightd was developed on machines
without a GPU (see docs/design/same-host.md, "CUDA path status"); ``tests/gpu/run_all.sh`` runs them
with the GPU benchmark on one GPU.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon
from tests.gpu.conftest import cuda_usable
from tests.shm.procs import Worker
from weightd.client import FailedPreconditionError, PackRef, WeightClient
from weightd.client.transports.local import LocalConnection, local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.common.cuda_driver import canonical_uuid
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not cuda_usable(), reason="needs CUDA (torch and libcuda.so.1)"),
]

FLAGS = ["--cuda-ipc", "--pin", "--pack-ttl", "1"]


@pytest.fixture(scope="module")
def daemon(
    gpu_demo_model: Path, gpu_big_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    models = [("demo", gpu_demo_model), ("big", gpu_big_model)]
    with run_daemon(tmp_path_factory.mktemp("gpu-daemon"), models, FLAGS) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(daemon.target, timeout=120) as c:
        yield c


def side(daemon: RunningDaemon) -> str:
    path = side_socket_path(daemon.target)
    assert path is not None
    return path


def gpu_leases(daemon: RunningDaemon) -> dict[tuple[str, int, int], int]:
    return {
        (p.model, p.layout.tp_size, p.layout.tp_rank): p.leases
        for p in local_stats(side(daemon)).packs
        if p.placement == lpb.PLACEMENT_CUDA
    }


def wait_until(ok: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        gc.collect()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def same_bytes(gpu: torch.Tensor, cpu: torch.Tensor) -> bool:
    return gpu.dtype == cpu.dtype and torch.equal(
        gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)
    )


def test_ipc_fetch_equals_the_original_bytes(client: WeightClient) -> None:
    for rank in range(2):
        ipc, info = client.fetch_with_info(
            rank, 2, model="big", device="cuda:0", transport="cuda_ipc", verify=True
        )
        assert info.transport == "cuda_ipc" and not info.copied
        assert info.pack is not None and info.pack.placement == "cuda"
        want = client.fetch(rank, 2, model="big", transport="grpc")
        assert list(ipc) == list(want)
        for name, t in ipc.items():
            assert t.device == torch.device("cuda:0") and t.shape == want[name].shape
            assert same_bytes(t, want[name]), name
        auto, auto_info = client.fetch_with_info(rank, 2, model="big", device="cuda:0")
        assert auto_info.transport == "cuda_ipc" and auto_info.fallbacks == ()
        name = "model.layers.1.mlp.down_proj.weight"
        assert auto[name].data_ptr() == ipc[name].data_ptr()  # one handle per process, shared


def test_every_tensor_lies_in_the_pack_allocation(client: WeightClient) -> None:
    state, info = client.fetch_with_info(0, 2, model="big", device="cuda:0", transport="cuda_ipc")
    assert info.pack is not None
    ptrs = sorted((t.data_ptr(), t.numel() * t.element_size()) for t in state.values())
    base = ptrs[0][0]
    assert all(p + n <= base + info.pack.size_bytes for p, n in ptrs)


def test_device_to_device_copy(client: WeightClient, daemon: RunningDaemon) -> None:
    shared = client.fetch(1, 2, model="big", device="cuda:0", transport="cuda_ipc")
    private, info = client.fetch_with_info(
        1, 2, model="big", device="cuda:0", transport="cuda_ipc", copy=True
    )
    assert info.copied and info.transport == "cuda_ipc"
    lo = min(t.data_ptr() for t in shared.values())
    hi = lo + (info.pack.size_bytes if info.pack else 0)
    for name, t in private.items():
        assert t.device.type == "cuda" and torch.equal(t, shared[name])
        assert not lo <= t.data_ptr() < hi  # its own memory, not the daemon's
    del shared
    wait_until(lambda: gpu_leases(daemon).get(("big", 2, 1)) == 0, "the GPU lease to end")
    assert torch.isfinite(private["model.norm.weight"].float()).all()


def test_lease_ends_when_the_client_is_killed(daemon: RunningDaemon) -> None:
    with Worker() as worker:
        reply = worker.ok(
            "fetch",
            target=daemon.target,
            rank=0,
            world_size=4,
            transport="cuda_ipc",
            device="cuda:0",
        )
        assert reply["transport"] == "cuda_ipc"
        assert gpu_leases(daemon)[("big", 4, 0)] == 1
        worker.kill()
    wait_until(lambda: gpu_leases(daemon).get(("big", 4, 0)) == 0, "the killed client's lease")


def test_stale_handle_is_refused_after_a_restart(gpu_demo_model: Path, tmp_path: Path) -> None:
    models = [("demo", gpu_demo_model)]
    with Worker() as worker:
        with run_daemon(tmp_path, models, FLAGS) as first:
            reply = worker.ok(
                "fetch",
                target=first.target,
                rank=1,
                world_size=2,
                transport="cuda_ipc",
                device="cuda:0",
            )
            ref = reply["pack"]
            assert ref["placement"] == "cuda"
            worker.ok("drop")
        with run_daemon(tmp_path, models, FLAGS) as second:
            stale = worker.call("attach", target=second.target, ref=ref)
            assert not stale["ok"] and stale["code"] == "FAILED_PRECONDITION"
            assert ref["boot_id"] in stale["error"]
            with WeightClient(second.target, timeout=60) as c:
                with pytest.raises(FailedPreconditionError, match="restarted"):
                    c.attach(PackRef(**ref))
                fresh, info = c.fetch_with_info(1, 2, device="cuda:0", transport="cuda_ipc")
                assert info.pack is not None and info.pack.boot_id != ref["boot_id"]
                assert fresh


def test_gpu_is_named_by_uuid(client: WeightClient, daemon: RunningDaemon) -> None:
    _, info = client.fetch_with_info(0, 1, model="demo", device="cuda:0", transport="cuda_ipc")
    assert info.pack is not None
    want = canonical_uuid(str(torch.cuda.get_device_properties(0).uuid))
    assert info.pack.gpu_uuid == want
    if torch.cuda.device_count() < 2:
        return
    # A worker seeing the GPUs in another order asks for its cuda:0, the host's last GPU.
    last = torch.cuda.device_count() - 1
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(last, -1, -1)))
    with Worker(env) as worker:
        reply = worker.ok(
            "fetch",
            target=daemon.target,
            rank=0,
            world_size=1,
            transport="cuda_ipc",
            device="cuda:0",
        )
    assert reply["pack"]["gpu_uuid"] == canonical_uuid(
        str(torch.cuda.get_device_properties(last).uuid)
    )


def test_pinned_staging(daemon: RunningDaemon, gpu_big_model: Path) -> None:
    """--pin: grants say pinned; and a pinned pack's H2D copy runs at DMA speed (printed)."""
    conn = LocalConnection(side(daemon), "shm", timeout=120)
    try:
        acquire = lpb.AcquirePack(model="big", layout=pb.Layout(tp_size=1, tp_rank=0))
        grant, fds = conn.request(lpb.LocalRequest(acquire=acquire), max_fds=1)
        for fd in fds:
            os.close(fd)
        assert grant.pinned
        assert local_stats(side(daemon)).pinned_bytes >= grant.size_bytes
    finally:
        conn.close()

    from weightd.common.cuda_driver import CudaDriver
    from weightd.server.packs.layoutbuild import build_host_pack
    from weightd.server.registry.models import load_model
    from weightd.server.transports.pinned import HostPinner

    model = load_model(str(gpu_big_model))
    driver = CudaDriver.load()
    try:
        pack = build_host_pack(model, model.plan(1, 0), "gpu-test")
        device = torch.empty(pack.size, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()

        def h2d() -> float:
            with driver.context(0):
                started = time.perf_counter()
                driver.memcpy_htod(device.data_ptr(), pack.address, pack.size)
                return time.perf_counter() - started

        h2d()  # warm up
        pageable = min(h2d() for _ in range(3))
        assert HostPinner(driver, pack.size).pin(pack) and pack.pinned
        pinned = min(h2d() for _ in range(3))
        assert bytes(device.cpu().numpy()) == pack.mapping[:]  # the very bytes of the pack
        print(
            f"\nH2D of a {pack.size / 1e6:.0f} MB pack: pageable {pack.size / pageable / 1e9:.1f} "
            f"GB/s, pinned {pack.size / pinned / 1e9:.1f} GB/s"
        )
        pack.close()  # unpins first
    finally:
        model.store.close()
