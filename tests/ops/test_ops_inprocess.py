"""The daemon built in-process by its factory, with an injected metrics registry.

Real gRPC over real sockets (and real TLS); the registry is read directly with
``get_sample_value``, so every assertion is on an exact number.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from tests.ops.pki import Pki
from weightd.client import (
    AdminClient,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
    WeightClient,
    tls_credentials,
)
from weightd.server.config import Named, ServeConfig
from weightd.server.daemon.assembly import Daemon, create_daemon, load_models
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

WEIGHTS = "weightd.v1.Weights"


@contextlib.contextmanager
def daemon_in_process(
    tmp: Path, models: list[tuple[str | None, str]], **overrides: Any
) -> Iterator[tuple[Daemon, CollectorRegistry]]:
    registry = CollectorRegistry()
    # The admin socket stays in this test's directory, whatever the worker listens on
    # (by default a TCP daemon's admin socket would go to the machine-wide directory).
    overrides.setdefault("admin__listen", f"unix://{tmp}/run/admin.sock")
    config = ServeConfig(
        model=tuple(Named(name, source) for name, source in models),
        listen=overrides.pop("listen", f"unix://{tmp}/run/weightd.sock"),
    )
    for path, value in overrides.items():  # section__field, as the settings' dest
        config.set(path.replace("__", "."), value)
    daemon = create_daemon(config, registry)
    try:
        load_models(daemon, models)
        yield daemon, registry
    finally:
        daemon.stop(0)


def test_metrics_follow_rpcs_and_memory(tmp_path: Path, demo_model: Path) -> None:
    with daemon_in_process(tmp_path, [("llama", str(demo_model))]) as (daemon, reg):
        with WeightClient(daemon.target, timeout=60) as client:
            state = client.fetch(0, 2, transport="grpc")
            with pytest.raises(NotFoundError):
                client.fetch(0, 2, model="nope", transport="grpc")
        sent = sum(t.numel() * t.element_size() for t in state.values())

        def value(name: str, **labels: str) -> float | None:
            return reg.get_sample_value(name, labels)

        assert value("weightd_served_bytes_total", transport="grpc", model="llama") == sent
        assert value("weightd_rpcs_total", service=WEIGHTS, method="Fetch", code="OK") == 1
        assert value("weightd_rpcs_total", service=WEIGHTS, method="Fetch", code="NOT_FOUND") == 1
        assert value("weightd_fetch_duration_seconds_count", transport="grpc") == 1
        assert value("weightd_active_streams", service=WEIGHTS, method="Fetch") == 0
        assert value("weightd_verification_duration_seconds_count", model="llama") == 1
        assert value("weightd_model_ready", model="llama") == 1
        # The made-up model name never became a label.
        assert value("weightd_served_bytes_total", transport="grpc", model="nope") is None

        shard_bytes = sum(p.stat().st_size for p in demo_model.glob("*.safetensors"))
        mapped = value("weightd_model_mapped_bytes", model="llama")
        resident = value("weightd_model_resident_bytes", model="llama")
        assert mapped == shard_bytes
        assert resident is not None and 0 < resident <= shard_bytes  # just read: cached
        assert value("process_resident_memory_bytes") is not None
        # No CUDA in this process: no GPU series at all (not zeros).
        assert value("weightd_gpu_allocated_bytes", device="cuda:0") is None


def test_shared_memory_fetches_are_counted_with_transport_shm(
    tmp_path: Path, demo_model: Path
) -> None:
    """The default on one host: each grant in the same series as a gRPC Fetch, labelled
    transport="shm", with the granted tensors' bytes (issue #39, point 6)."""
    with daemon_in_process(tmp_path, [("llama", str(demo_model))]) as (daemon, reg):
        with WeightClient(daemon.target, timeout=60) as client:
            state, info = client.fetch_with_info(1, 2, transport="shm")
            assert info.transport == "shm"
            names = sorted(state)[:3]
            client.fetch(0, 2, transport="shm", names=names)
            with pytest.raises(NotFoundError):
                client.fetch(0, 2, model="nope", transport="shm")
        whole = sum(t.numel() * t.element_size() for t in state.values())

        def value(name: str, **labels: str) -> float | None:
            return reg.get_sample_value(name, labels)

        local = "weightd.v1.Local"
        assert value("weightd_rpcs_total", service=local, method="AcquirePack", code="OK") == 2
        assert (
            value("weightd_rpcs_total", service=local, method="AcquirePack", code="NOT_FOUND") == 1
        )
        served = value("weightd_served_bytes_total", transport="shm", model="llama")
        assert served is not None and whole < served < 2 * whole  # rank 1 whole, 3 of rank 0
        assert value("weightd_fetch_duration_seconds_count", transport="shm") == 2
        assert value("weightd_served_bytes_total", transport="shm", model="nope") is None
        assert value("weightd_rpcs_total", service=WEIGHTS, method="Fetch", code="OK") is None


def test_admin_only_on_the_admin_listener_and_reload_swaps_only_on_success(
    tmp_path: Path, demo_model: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    with daemon_in_process(tmp_path, [("llama", str(model))]) as (daemon, reg):
        assert daemon.admin_address is not None
        admin_target = daemon.admin_address.grpc_target
        assert os.stat(os.path.dirname(daemon.admin_address.path)).st_mode & 0o777 == 0o700

        # Admin on the worker listener: refused, with the reason.
        with (
            AdminClient(daemon.target, timeout=30) as wrong,
            pytest.raises(
                PermissionDeniedError, match=f"connect to the admin listener at {admin_target}"
            ),
        ):
            wrong.reload("llama")
        assert (
            reg.get_sample_value(
                "weightd_rpcs_total",
                {"service": "weightd.v1.Admin", "method": "Reload", "code": "PERMISSION_DENIED"},
            )
            == 1
        )

        with AdminClient(admin_target, timeout=60) as admin:
            result = admin.reload("llama")
            assert result.model == "llama" and result.num_tensors > 0
            assert (
                reg.get_sample_value("weightd_reloads_total", {"model": "llama", "outcome": "ok"})
                == 1
            )

            (model / "config.json").write_text("{broken")
            with pytest.raises(FailedPreconditionError, match="not valid JSON"):
                admin.reload("llama")
            with pytest.raises(NotFoundError):
                admin.reload("other")
        labels = {"model": "llama", "reason": "config"}
        assert reg.get_sample_value("weightd_verification_failures_total", labels) == 1
        assert (
            reg.get_sample_value("weightd_reloads_total", {"model": "llama", "outcome": "failed"})
            == 1
        )
        # The verified version still serves.
        with WeightClient(daemon.target, timeout=60) as client:
            assert len(client.fetch(1, 2)) > 0


def test_resumes_are_counted_by_outcome(tmp_path: Path, demo_model: Path) -> None:
    """A resume that is served and one refused (other content) each move their series."""
    with daemon_in_process(tmp_path, [("llama", str(demo_model))]) as (daemon, reg):
        request = pb.FetchRequest(model="llama", layout=pb.Layout(tp_size=2, tp_rank=1))
        with grpc.insecure_channel(daemon.target) as channel:
            stub = pb_grpc.WeightsStub(channel)
            whole = list(stub.Fetch(request, timeout=60))
            served = whole[0].model_fingerprint
            indices = {c.index for r in whole for c in r.chunks}
            assert served and len(indices) > 3

            resumed = pb.FetchRequest()
            resumed.CopyFrom(request)
            resumed.start_index, resumed.model_fingerprint = 3, served
            rest = {c.index for r in stub.Fetch(resumed, timeout=60) for c in r.chunks}
            assert rest == {i for i in indices if i >= 3}

            resumed.model_fingerprint = "0" * len(served)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Fetch(resumed, timeout=60))
            assert refused.value.code() is grpc.StatusCode.ABORTED

        def resumes(outcome: str) -> float | None:
            return reg.get_sample_value(
                "weightd_fetch_resumes_total", {"model": "llama", "outcome": outcome}
            )

        # The first, whole fetch (start_index 0) is not a resume.
        assert resumes("resumed") == 1
        assert resumes("refused") == 1


def _raw_stub(target: str) -> tuple[grpc.Channel, pb_grpc.WeightsStub]:
    # No BDP probing: the receive window stays small, so an unread stream really stalls.
    channel = grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
    return channel, pb_grpc.WeightsStub(channel)


def test_bounds_answer_resource_exhausted(tmp_path: Path, big_model: Path) -> None:
    with daemon_in_process(
        tmp_path, [("big", str(big_model))], server__max_concurrent_rpcs=1, server__max_workers=4
    ) as (daemon, _):
        channel, stub = _raw_stub(daemon.target)
        with channel:
            request = pb.FetchRequest(layout=pb.Layout(tp_size=1, tp_rank=0))
            held = stub.Fetch(request, timeout=60)
            next(held)  # the stream is running on the daemon and stays there, unread
            with pytest.raises(grpc.RpcError) as info:
                stub.ListModels(pb.ListModelsRequest(), timeout=30)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            held.cancel()

    with daemon_in_process(tmp_path / "b", [("big", str(big_model))]) as (daemon, _):
        channel, stub = _raw_stub(daemon.target)
        with channel:
            too_many = pb.FetchRequest(
                layout=pb.Layout(tp_size=1, tp_rank=0), names=["blob"] * 70_000
            )
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Fetch(too_many, timeout=30))
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "the limit is 65536" in (info.value.details() or "")

            huge = pb.FetchRequest(layout=pb.Layout(tp_size=1, tp_rank=0), names=["x" * (2 << 20)])
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Fetch(huge, timeout=30))
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_stream_time_cap_answers_deadline_exceeded(tmp_path: Path, big_model: Path) -> None:
    with daemon_in_process(
        tmp_path, [("big", str(big_model))], server__max_stream_seconds=1e-6
    ) as (
        daemon,
        reg,
    ):
        channel, stub = _raw_stub(daemon.target)
        with channel:
            request = pb.FetchRequest(layout=pb.Layout(tp_size=1, tp_rank=0))
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Fetch(request, timeout=60))
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--max-stream-seconds" in (info.value.details() or "")
        labels = {"service": WEIGHTS, "method": "Fetch", "code": "DEADLINE_EXCEEDED"}
        assert reg.get_sample_value("weightd_rpcs_total", labels) == 1


def test_tls_only_listener(tmp_path: Path, demo_model: Path, pki: Pki) -> None:
    with daemon_in_process(
        tmp_path,
        [("llama", str(demo_model))],
        listen="127.0.0.1:0",
        tls__cert=str(pki.server.cert),
        tls__key=str(pki.server.key),
    ) as (daemon, _):
        creds = tls_credentials(ca=str(pki.ca))
        with WeightClient(daemon.target, timeout=30, credentials=creds) as client:
            assert client.list_models()[0].ready
        with WeightClient(daemon.target, timeout=5) as plaintext, pytest.raises(Exception) as info:
            plaintext.list_models()
        assert getattr(info.value, "code", None) is grpc.StatusCode.UNAVAILABLE


def test_a_request_naming_no_model_while_the_models_load_is_told_to_wait(
    tmp_path: Path, demo_model: Path
) -> None:
    """The listeners are up before the first model verifies: a fetch that names no
    model then must hear "still being verified" (UNAVAILABLE, which clients retry), not
    that the daemon serves no models (INVALID_ARGUMENT, the caller's mistake)."""
    from weightd.client import NotServing

    config = ServeConfig(
        model=(Named("llama", str(demo_model)),),
        listen=f"unix://{tmp_path}/run/weightd.sock",
    )
    config.set("admin.listen", f"unix://{tmp_path}/run/admin.sock")
    daemon = create_daemon(config, CollectorRegistry())
    try:  # serving, no model loaded yet: what a client sees between bind and verify
        with WeightClient(daemon.target, timeout=30) as client:
            with pytest.raises(NotServing) as info:
                client.fetch(0, 1, transport="grpc")
            assert info.value.reason == "ModelNotReady"
            assert "'llama' is still being verified" in info.value.detail
            with pytest.raises(NotServing) as info:  # the side socket, open from its creation
                client.fetch(0, 1, transport="shm")
            assert info.value.reason == "ModelNotReady"
            listed = {m.name: m.state for m in client.list_models()}
            assert listed == {"llama": "loading"}
        load_models(daemon, [("llama", str(demo_model))])
        with WeightClient(daemon.target, timeout=30) as client:
            assert client.fetch(0, 1, transport="grpc")
    finally:
        daemon.stop(0)
