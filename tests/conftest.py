"""Shared fixtures: tiny real checkpoints and a daemon started out of process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc


@dataclass
class RunningDaemon:
    process: subprocess.Popen[str]
    target: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


def wait_serving(
    target: str, process: subprocess.Popen[str], log_path: Path, timeout: float = 120
) -> None:
    """Poll grpc.health.v1 until the overall status is SERVING (or the daemon dies)."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"daemon exited with {process.returncode}:\n{log_path.read_text()}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"daemon not SERVING after {timeout}s:\n{log_path.read_text()}")


def weightd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightd.server.cli", *args]


@contextlib.contextmanager
def run_daemon(
    tmp: Path, models: Sequence[tuple[str, Path]], extra: Sequence[str] = ()
) -> Iterator[RunningDaemon]:
    """Start ``weightd serve`` in its own process on a private Unix socket."""
    sock = tmp / "run" / "weightd.sock"
    log_path = tmp / "daemon.log"
    args = ["serve", "--listen", f"unix://{sock}"]
    for name, directory in models:
        args += ["--model", f"{name}={directory}"]
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp / "cache"))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            weightd_command(*args, *extra), stdout=log, stderr=subprocess.STDOUT, text=True, env=env
        )
    target = f"unix://{sock}"
    try:
        wait_serving(target, process, log_path)
        yield RunningDaemon(process, target, log_path)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="session")
def transformers_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small random models written by ``transformers`` itself, sharded with an index."""
    from tests.models import write_transformers_models

    return write_transformers_models(tmp_path_factory.mktemp("hf-models"))
