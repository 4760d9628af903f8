"""Requests a client gets wrong are the client's error, counted, bounded (#15 item 12).

Out of process against a real daemon: bytes that are no message of the method's type,
and strings far longer than any name. Before, the first answered INTERNAL with an ERROR
traceback per call ("Exception deserializing request!") and was not counted in
``weightd_rpcs_total``; the second echoed a 900 KB model name back whole in the detail.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RunningDaemon, run_daemon
from tests.reliability.load_support import demo_model
from weightd.client import ResourceExhaustedError, WeightClient
from weightd.client.transports.local import LocalConnection
from weightd.client.transports.selection import side_socket_path
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

pytestmark = pytest.mark.e2e
__all__ = ["demo_model"]  # the fixture, shared with the other reliability tests

#: Not a protobuf message of any kind: a field key with wire type 7 (invalid).
JUNK = b"\x0f\xff\xff\xff\xff"
HUGE = "m" * 900_000


@pytest.fixture(scope="module")
def daemon(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("hostile-requests")
    extra = [
        "--metrics-listen",
        "127.0.0.1:0",
        "--health-listen",
        "127.0.0.1:0",
        "--admin-listen",
        f"unix://{tmp}/run/admin.sock",
    ]
    with run_daemon(tmp, [("llama", demo_model)], extra) as d:
        yield d


def _raw(target: str, method: str, payload: bytes, streaming: bool = False) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        if streaming:
            call = channel.unary_stream(method)
            with pytest.raises(grpc.RpcError) as err:
                list(call(payload, timeout=30))
        else:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(method)(payload, timeout=30)
    return err.value


def _rpcs_total(daemon: RunningDaemon, service: str, method: str, code: str) -> float:
    url = daemon.address("metrics")  # the full URL, /metrics included
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "weightd_rpcs_total" and s.labels == {
                "service": service,
                "method": method,
                "code": code,
            }:
                return s.value
    return 0.0


@pytest.mark.parametrize(
    ("listener", "method", "streaming"),
    [
        ("worker", "/weightd.v1.Weights/Fetch", True),
        ("worker", "/weightd.v1.Weights/DescribeModel", False),
        ("worker", "/weightd.v1.Weights/FetchAdapter", True),
        ("worker", "/grpc.health.v1.Health/Check", False),
        ("admin", "/weightd.v1.Admin/LoadAdapter", False),
        ("admin", "/weightd.v1.Admin/Reload", False),
        ("health", "/grpc.health.v1.Health/Check", False),
    ],
)
def test_undecodable_requests_are_invalid_argument_and_counted(
    daemon: RunningDaemon, listener: str, method: str, streaming: bool
) -> None:
    target = daemon.target if listener == "worker" else daemon.address(listener)
    service, name = method.lstrip("/").rsplit("/", 1)
    before = _rpcs_total(daemon, service, name, "INVALID_ARGUMENT")
    err = _raw(target, method, JUNK, streaming)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"request to {method} is not a valid message" in (err.details() or "")
    assert _rpcs_total(daemon, service, name, "INVALID_ARGUMENT") == before + 1
    log = daemon.log()
    assert "Exception deserializing" not in log
    assert "Traceback" not in log


def test_a_huge_model_name_is_refused_with_a_short_detail(daemon: RunningDaemon) -> None:
    request = pb.DescribeModelRequest(model=HUGE).SerializeToString()
    err = _raw(daemon.target, "/weightd.v1.Weights/DescribeModel", request)
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    detail = err.details() or ""
    assert "field model is 900000 bytes" in detail and "the limit is 256" in detail
    assert len(detail) < 400  # the name is quoted cut short, never echoed whole
    # The daemon keeps serving everything else.
    with WeightClient(daemon.target, timeout=60) as c:
        assert c.fetch(0, 2, transport="grpc")


def test_an_unknown_model_name_is_quoted_cut_short(daemon: RunningDaemon) -> None:
    with WeightClient(daemon.target, timeout=60) as c, pytest.raises(Exception) as err:
        c.describe("x" * 250)  # within the bound, so the lookup itself answers
    detail = str(err.value)
    assert "is not served here" in detail and "(250 bytes)" in detail
    assert "x" * 100 not in detail


def test_the_side_channel_bounds_the_same_fields(daemon: RunningDaemon) -> None:
    path = side_socket_path(daemon.target)
    assert path is not None and os.path.exists(path)
    conn = LocalConnection(path, "shm", timeout=30)
    try:
        acquire = lpb.AcquirePack(model="m" * 5_000, layout=pb.Layout(tp_size=1))
        with pytest.raises(ResourceExhaustedError) as err:
            conn.request(lpb.LocalRequest(acquire=acquire), max_fds=1)
    finally:
        conn.close()
    assert "field acquire.model is 5000 bytes" in err.value.detail
    assert len(err.value.detail) < 400
    assert err.value.transport is None  # the caller's fault, not the transport's
