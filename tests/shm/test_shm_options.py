"""Start-up options of the same-host transports, as an operator meets them."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_daemon, weightd_command
from weightd.client import UnavailableError, WeightClient

pytestmark = pytest.mark.e2e


def _cuda_usable() -> bool:
    from weightd.common.cuda_driver import CudaDriver, CudaDriverError

    try:
        return CudaDriver.load().device_count() > 0
    except CudaDriverError:
        return False


@pytest.mark.skipif(_cuda_usable(), reason="this host has CUDA: the options would start")
@pytest.mark.parametrize("flags", [["--pin", "--pin-budget-bytes", "1000000"], ["--cuda-ipc"]])
def test_cuda_options_fail_at_start_without_cuda(tmp_path: Path, flags: list[str]) -> None:
    done = subprocess.run(
        weightd_command("serve", "--listen", f"unix://{tmp_path}/run/w.sock", *flags),
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp_path / "cache")),
    )
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr
    assert f"{flags[0]} need CUDA" in errors[0] and "libcuda.so.1" in errors[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run" / "w.sock").exists()  # it failed before listening


def test_pin_needs_the_side_socket(tmp_path: Path) -> None:
    done = subprocess.run(
        weightd_command("serve", "--listen", "127.0.0.1:0", "--insecure", "--pin"),
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp_path / "cache")),
    )
    assert done.returncode == 1
    assert "--pin need the side socket" in done.stderr and "Traceback" not in done.stderr


def test_no_shm_means_grpc_and_says_why(
    demo_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with run_daemon(tmp_path, [("demo", demo_model)], ["--no-shm"]) as daemon:
        assert not (tmp_path / "run" / "weightd.sock.local").exists()
        with WeightClient(daemon.target, timeout=60) as client:
            with caplog.at_level(logging.WARNING):
                state, info = client.fetch_with_info(0, 2)
            assert state and info.transport == "grpc" and info.fallbacks == ()
            assert "no side socket" in info.reason and "--no-shm" in info.reason
            assert not caplog.records  # a transport that does not apply is not a failure
            with pytest.raises(UnavailableError) as err:
                client.fetch(0, 2, transport="shm")
            assert err.value.transport == "shm" and "no side socket" in err.value.detail
