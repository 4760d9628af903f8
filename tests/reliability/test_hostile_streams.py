"""Every server stream is bounded, and health answers whatever streams do (#15 items 7, 8).

Out of process against real daemons, loopback and Unix sockets only. Before:

* a stalled ``FetchAdapter`` ran past ``--max-stream-seconds`` and kept its lease on the
  adapter version (only Fetch was watched); watches ran forever;
* two ``Watch`` streams on ``--health-listen`` took both of its threads, so ``Check``
  answered DEADLINE_EXCEEDED (the DaemonSet's liveness probe: anyone on the pod network
  could restart the pod); and with every worker thread held by stalled streams the
  health listener still said SERVING.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from tests.conftest import RunningDaemon, run_daemon
from tests.reliability.load_support import demo_model
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e
__all__ = ["demo_model"]

MAX_STREAM_SECONDS = 4
IDLE_SECONDS = 3
#: Flow control must hold the daemon back: no BDP probing, small messages.
NO_BDP = [("grpc.http2.bdp_probe", 0)]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS = "weightd.v1.Liveness"


def _big_adapter(out: Path) -> Path:
    """A LoRA adapter for the demo model, r=128 on the MLP: 6 MiB, far past any window."""
    out.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    shapes = {"gate_proj": (768, 256), "up_proj": (768, 256), "down_proj": (256, 768)}
    for layer in range(4):
        for module, (rows, cols) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.mlp.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(128, cols, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, 128, generator=g)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 128, "lora_alpha": 256, "target_modules": list(shapes)}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def bounded(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """A daemon with short stream bounds and an adapter loaded."""
    tmp = tmp_path_factory.mktemp("hostile-streams")
    adapter = _big_adapter(tmp / "adapters" / "big")
    extra = [
        "--adapter-root",
        str(tmp / "adapters"),
        "--max-stream-seconds",
        str(MAX_STREAM_SECONDS),
        "--stream-idle-seconds",
        str(IDLE_SECONDS),
        "--metrics-listen",
        "127.0.0.1:0",
    ]
    with run_daemon(tmp, [("demo", demo_model)], extra) as d:
        with AdminClient(f"unix://{tmp / 'run' / 'admin.sock'}", timeout=60) as admin:
            admin.load_adapter("big", str(adapter))
        with WeightClient(d.target, timeout=60) as client:
            assert client.fetch(0, 1, transport="grpc")  # anchors every tensor once
        yield d


def _admin(d: RunningDaemon) -> AdminClient:
    return AdminClient(f"unix://{d.log_path.parent / 'run' / 'admin.sock'}", timeout=60)


def _active(d: RunningDaemon, method: str) -> float:
    with urllib.request.urlopen(d.address("metrics"), timeout=30) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "weightd_active_streams" and s.labels.get("method") == method:
                return s.value
    return 0.0


def _until(check: Any, seconds: float = 60) -> bool:
    """Poll ``check`` (bounded); True once it holds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def _stalled(channel: grpc.Channel, method: str) -> Any:
    """Start a stream, take its first message, then stop reading."""
    stub = pb_grpc.WeightsStub(channel)
    layout = pb.Layout(tp_size=1, tp_rank=0)
    if method == "FetchAdapter":
        call = stub.FetchAdapter(
            pb.FetchAdapterRequest(name="big", layout=layout, max_chunk_bytes=16 << 10),
            timeout=120,
        )
    else:
        call = stub.Fetch(pb.FetchRequest(layout=layout, max_chunk_bytes=16 << 10), timeout=120)
    next(call)
    return call


@pytest.mark.parametrize("method", ["FetchAdapter", "Fetch"])
def test_a_stalled_stream_is_cancelled_and_lets_go_of_its_lease(
    bounded: RunningDaemon, method: str
) -> None:
    with grpc.insecure_channel(bounded.target, options=NO_BDP) as channel, _admin(bounded) as adm:
        call = _stalled(channel, method)
        if method == "FetchAdapter":
            assert [a.leases for a in adm.list_adapters()] == [1]
        assert _active(bounded, method) == 1
        # Nobody reads: the idle bound cancels it, and the lease goes with it.
        assert _until(lambda: _active(bounded, method) == 0)
        assert [a.leases for a in adm.list_adapters()] == [0]
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() is grpc.StatusCode.CANCELLED
        # The operator's next load is not held up by a version nobody reads.
        adm.unload_adapter("big")
        source = bounded.log_path.parent / "adapters" / "big"
        assert adm.load_adapter("big", str(source)).version >= 2
    assert f"{method} stream its client took no message for {IDLE_SECONDS}s" in bounded.log()


@pytest.mark.parametrize("watch", ["WatchAdapters", "Health/Watch"])
def test_watches_end_at_the_stream_cap(bounded: RunningDaemon, watch: str) -> None:
    started = time.monotonic()
    with grpc.insecure_channel(bounded.target) as channel:
        if watch == "WatchAdapters":
            call = pb_grpc.WeightsStub(channel).WatchAdapters(
                pb.WatchAdaptersRequest(), timeout=120
            )
        else:
            call = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=120
            )
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
    took = time.monotonic() - started
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert took < 100  # the daemon ended it, not the client's 120 s deadline
    assert f"ran past the {MAX_STREAM_SECONDS}s stream limit (--max-stream-seconds)" in (
        bounded.log()
    )


# --- health under any client behaviour --------------------------------------------------


@pytest.fixture(scope="module")
def crowded(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """Two stream slots, no duration cap: the test ends the streams it opens (well
    within the default 60 s idle bound; only flags the old daemon knew, so the same
    attacks run against it)."""
    tmp = tmp_path_factory.mktemp("hostile-health")
    extra = ["--max-workers", "2", "--max-stream-seconds", "0", "--health-listen", "127.0.0.1:0"]
    with run_daemon(tmp, [("demo", demo_model)], extra) as d:
        with WeightClient(d.target, timeout=60) as client:
            assert client.fetch(0, 1, transport="grpc")
        yield d


def _check(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
    return int(reply.status)


def test_watch_streams_cannot_starve_check_on_the_health_listener(crowded: RunningDaemon) -> None:
    target = crowded.address("health")
    channels = [grpc.insecure_channel(target) for _ in range(6)]
    try:
        calls = [
            health_pb2_grpc.HealthStub(c).Watch(health_pb2.HealthCheckRequest(), timeout=120)
            for c in channels
        ]
        refused = 0
        for call in calls:
            try:
                next(call)
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert "streams open already" in (exc.details() or "")
                refused += 1
        assert refused >= 1  # the Watch cap, below the listener's threads
        for _ in range(5):
            assert _check(target) == SERVING  # answered, not DEADLINE_EXCEEDED
    finally:
        for c in channels:
            c.close()


def test_health_says_not_serving_while_the_worker_listener_is_full(
    crowded: RunningDaemon,
) -> None:
    health = crowded.address("health")
    assert _check(health) == SERVING
    channels = [grpc.insecure_channel(crowded.target, options=NO_BDP) for _ in range(2)]
    try:
        calls = [_stalled(c, "Fetch") for c in channels]  # both stream slots, stalled
        with grpc.insecure_channel(crowded.target) as extra, pytest.raises(grpc.RpcError) as err:
            _stalled(extra, "Fetch")
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _check(health) == NOT_SERVING  # a worker would be refused: say so
        assert _check(health, "weightd.v1.Weights") == NOT_SERVING
        assert _check(health, LIVENESS) == SERVING  # busy is not dead: no restart
        assert _check(crowded.target) == SERVING  # unary calls keep their threads
        with WeightClient(crowded.target, timeout=30) as client:
            assert client.list_models()
        for call in calls:
            call.cancel()
        assert _until(lambda: _check(health) == SERVING)
    finally:
        for c in channels:
            c.close()
