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

from tests.health import listening_address, wait_serving


@dataclass
class RunningDaemon:
    process: subprocess.Popen[str]
    target: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def address(self, listener: str) -> str:
        """Where the ``listening`` event says ``listener`` (worker, admin, metrics...) is."""
        found = listening_address(self.log(), listener)
        assert found is not None, f"no {listener} listener in the log:\n{self.log()}"
        return found


def weightd_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightd.server.cli.main", *args]


@contextlib.contextmanager
def run_daemon(
    tmp: Path,
    models: Sequence[tuple[str, Path]],
    extra: Sequence[str] = (),
    *,
    listen: str | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[RunningDaemon]:
    """Start ``weightd serve`` in its own process on a private Unix socket.

    ``listen`` (e.g. ``127.0.0.1:0``) serves TCP instead; the bound port is read from
    the daemon's ``listening`` event. ``credentials`` are used for the readiness probe.
    """
    sock = tmp / "run" / "weightd.sock"
    log_path = tmp / "daemon.log"
    args = ["serve", "--listen", listen or f"unix://{sock}"]
    if listen is not None and "--admin-listen" not in extra:
        # A TCP daemon's admin socket would default to the machine-wide directory.
        args += ["--admin-listen", f"unix://{tmp}/run/admin.sock"]
    for name, directory in models:
        args += ["--model", f"{name}={directory}"]
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp / "cache"))
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            weightd_command(*args, *extra), stdout=log, stderr=subprocess.STDOUT, text=True, env=env
        )
    target = f"unix://{sock}"
    try:
        if listen is not None:
            target = _wait_listening(process, log_path)
        wait_serving(target, process, log_path, credentials=credentials)
        yield RunningDaemon(process, target, log_path)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_listening(process: subprocess.Popen[str], log_path: Path, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = listening_address(log_path.read_text(), "worker")
        if found is not None:
            return found
        if process.poll() is not None:
            raise RuntimeError(f"daemon exited with {process.returncode}:\n{log_path.read_text()}")
        time.sleep(0.1)
    raise RuntimeError(f"daemon did not listen within {timeout}s:\n{log_path.read_text()}")


@pytest.fixture(scope="session")
def transformers_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small random models written by ``transformers`` itself, sharded with an index."""
    from tests.models import write_transformers_models

    return write_transformers_models(tmp_path_factory.mktemp("hf-models"))
