"""Adapters over CUDA IPC against a real daemon (marker ``gpu``).

Skips where there is no usable CUDA (torch and the driver API both). **Never run
yet:** weightd is developed on machines without a GPU; ``tests/gpu/run_all.sh`` runs
this file with the other GPU tests.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.adapters.conftest import Fixture, same_bytes
from tests.conftest import run_daemon
from tests.gpu.conftest import cuda_usable
from tests.gpu.test_cuda_ipc import wait_until
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient
from weightd.client.transports.local import local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.v1 import local_pb2 as lpb

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.e2e,
    pytest.mark.skipif(not cuda_usable(), reason="needs CUDA (torch and libcuda.so.1)"),
]


def gpu_adapter_packs(target: str) -> dict[tuple[str, int, int], int]:
    """(adapter, version, rank) -> leases of the adapter packs placed on a GPU."""
    path = side_socket_path(target)
    assert path is not None
    return {
        (p.adapter, p.adapter_version, p.layout.tp_rank): p.leases
        for p in local_stats(path).packs
        if p.adapter and p.placement == lpb.PLACEMENT_CUDA
    }


def on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.cpu() for n, t in tensors.items()}


def test_cuda_ipc_adapter_equals_grpc_and_holds_its_version(lora: Fixture, tmp_path: Path) -> None:
    extra = ["--adapter-root", str(lora.root), "--cuda-ipc", "--pack-ttl", "600"]
    with (
        run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as d,
        AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=120) as admin,
        WeightClient(d.target, timeout=120) as client,
    ):
        v1 = admin.load_adapter("g", str(lora.adapter_dir))
        reference = {}
        for rank in range(2):
            grpc = client.fetch_adapter("g", rank, 2, transport="grpc")
            gpu = client.fetch_adapter("g", rank, 2, transport="cuda_ipc")
            auto = client.fetch_adapter("g", rank, 2, device="cuda")
            for got in (gpu, auto):
                assert got.transport == "cuda_ipc" and got.version == v1.version
                assert got.digest == grpc.digest and got.scaling == grpc.scaling
                assert all(t.is_cuda for t in got.tensors.values())
                assert same_bytes(on_cpu(got.tensors), grpc.tensors)
            reference[rank] = grpc.tensors
            del grpc, gpu, auto, got

        held = client.fetch_adapter("g", 0, 2, transport="cuda_ipc")
        v2 = admin.load_adapter("g", str(lora.second_dir))  # replace while the GPU pack is open
        assert same_bytes(on_cpu(held.tensors), reference[0])
        assert gpu_adapter_packs(d.target)[("g", v1.version, 0)] == 1
        fresh = client.fetch_adapter("g", 0, 2, transport="cuda_ipc")
        assert fresh.version == v2.version and fresh.transport == "cuda_ipc"
        assert same_bytes(
            on_cpu(fresh.tensors), client.fetch_adapter("g", 0, 2, transport="grpc").tensors
        )

        del held, fresh
        gc.collect()
        torch.cuda.synchronize()
        admin.unload_adapter("g")
        wait_until(lambda: not gpu_adapter_packs(d.target), "the GPU adapter packs to be freed")
        assert admin.list_adapters() == []
