"""Fixtures for the GPU tests (marker ``gpu``): they skip cleanly where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shm.bigmodel import write_big_model


def cuda_usable() -> bool:
    """torch sees a GPU and the driver API loads (both are needed: torch for tensors,
    libcuda for the IPC calls weightd makes itself)."""
    import torch

    if not torch.cuda.is_available():
        return False
    from weightd.common.cuda_driver import CudaDriver, CudaDriverError

    try:
        return CudaDriver.load().device_count() > 0
    except CudaDriverError:
        return False


@pytest.fixture(scope="session")
def gpu_big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_big_model(tmp_path_factory.mktemp("gpu-big") / "big-llama")


@pytest.fixture(scope="session")
def gpu_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from weightd.server.cli.demo import ensure_demo_checkpoint

    return Path(ensure_demo_checkpoint(str(tmp_path_factory.mktemp("gpu-demo"))))
