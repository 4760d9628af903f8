"""Helpers for the changed-files and resources tests: a daemon serving a copy of a
``transformers`` checkpoint that the test may damage, and ways to watch it react."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RunningDaemon, run_daemon
from tests.models import expected_slice
from tests.ops.conftest import scrape
from weightd.client import ModelInfo, WeightClient

T = TypeVar("T")
WEIGHTS = "weightd.v1.Weights"


@dataclass
class Served:
    """A daemon serving ``victim`` (a private copy the test damages) and ``other``."""

    daemon: RunningDaemon
    tmp: Path
    victim: Path
    other: Path
    original: dict[str, torch.Tensor]  # the victim's tensors as verified
    config: dict[str, object]

    @property
    def target(self) -> str:
        return self.daemon.target

    @property
    def admin_target(self) -> str:
        return f"unix://{self.tmp / 'run' / 'admin.sock'}"

    def shard(self, index: int = 0) -> Path:
        return sorted(self.victim.glob("*.safetensors"))[index]

    def metrics_url(self) -> str:
        return self.daemon.address("metrics")


@contextlib.contextmanager
def serve_copy(
    tmp: Path, victim_src: Path, other: Path, extra: Sequence[str] = ()
) -> Iterator[Served]:
    """Copy ``victim_src`` and serve it next to ``other``, watching files every 0.1 s."""
    victim = tmp / "victim"
    shutil.copytree(victim_src, victim)
    args = ["--watch-interval", "0.1", "--metrics-listen", "127.0.0.1:0", *extra]
    with run_daemon(tmp, [("victim", victim), ("other", other)], args) as daemon:
        config = json.loads((victim / "config.json").read_text())
        yield Served(daemon, tmp, victim, other, read_tensors(victim), config)


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, from bytes read now: never a file mapping, which a
    test that truncates the file afterwards would turn into SIGBUS in the test itself."""
    from safetensors.torch import load

    out: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        out.update(load(shard.read_bytes()))
    return out


def wait_for(
    what: str, probe: Callable[[], T | None], daemon: RunningDaemon, timeout: float = 60
) -> T:
    """Poll ``probe`` until it returns something; fail naming ``what`` (with the log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert daemon.process.poll() is None, f"daemon died:\n{daemon.log()}"
        got = probe()
        if got is not None:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; daemon log:\n{daemon.log()}")


def model_info(target: str, name: str) -> ModelInfo:
    with WeightClient(target, timeout=30) as client:
        (info,) = [m for m in client.list_models() if m.name == name]
    return info


def wait_state(served: Served, name: str, state: str, needle: str = "") -> ModelInfo:
    """Wait until ListModels reports ``state`` for ``name`` with ``needle`` in its reason."""

    def probe() -> ModelInfo | None:
        info = model_info(served.target, name)
        return info if info.state == state and needle in info.reason else None

    return wait_for(f"model {name} {state} ({needle!r})", probe, served.daemon)


def wait_log(served: Served, needle: str) -> None:
    wait_for(repr(needle), lambda: needle in served.daemon.log() or None, served.daemon)


def health(target: str, model: str = "") -> int:
    """The grpc.health.v1 status of ``model`` (empty: the whole daemon)."""
    import grpc

    service = f"{WEIGHTS}/{model}" if model else ""
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=30
        )
    return int(reply.status)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of a scrape, or None when absent."""
    for family in text_string_to_metric_families(scrape(url)):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def assert_rank(
    state: dict[str, torch.Tensor],
    original: dict[str, torch.Tensor],
    config: dict[str, object],
    world_size: int,
    rank: int,
) -> None:
    """``state`` holds exactly the rank's slices of ``original``, bit for bit."""
    assert set(state) == set(original)
    for name, full in original.items():
        want = expected_slice(name, full, config, world_size, rank).contiguous()
        got = state[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def fetch(
    target: str, model: str, rank: int, world_size: int, transport: str
) -> dict[str, torch.Tensor]:
    """A fetch whose digests the client checks itself (``verify`` re-hashes shm packs too)."""
    with WeightClient(target, timeout=60) as client:
        state = client.fetch(rank, world_size, model=model, transport=transport, verify=True)
        return {n: t.clone() for n, t in state.items()}


def flip_tail(data: bytes, count: int = 64) -> bytes:
    """``data`` (a whole shard) with its last ``count`` bytes changed: still a valid
    safetensors file (the end of the data section), holding other values."""
    out = bytearray(data)
    for i in range(len(out) - count, len(out)):
        out[i] ^= 0x5A
    return bytes(out)


def rename_into_place(path: Path, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically: a temporary file beside it, renamed over."""
    tmp = path.with_name(path.name + ".incoming")
    tmp.write_bytes(data)
    os.replace(tmp, path)
