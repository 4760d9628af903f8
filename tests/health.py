"""Waiting for a daemon to serve, without pytest: tests and benchmarks share it.

``bench/`` scripts run where pytest may be absent (``bench/vllm_load.py`` runs in
``.venv-vllm``), so this lives apart from ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def wait_serving(
    target: str,
    process: subprocess.Popen[str],
    log_path: Path,
    timeout: float = 120,
    credentials: grpc.ChannelCredentials | None = None,
    poll: float = 0.1,
    service: str = "",
) -> None:
    """Poll grpc.health.v1 until ``service``'s status (default: the overall one) is
    SERVING, or the daemon dies."""
    deadline = time.monotonic() + timeout
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"daemon exited with {process.returncode}:\n{log_path.read_text()}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(poll)
    raise RuntimeError(f"daemon not SERVING after {timeout}s:\n{log_path.read_text()}")


def listening_address(log: str, listener: str) -> str | None:
    """The address of ``listener`` from the daemon's ``listening`` lifecycle event
    (text lines, or JSON lines with ``--log-json``)."""
    for line in log.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == "listening" and record.get("listener") == listener:
                return str(record["address"])
            continue
        m = re.search(rf"listening listener={listener} address=(\S+)", line)
        if m:
            return m.group(1)
    return None
