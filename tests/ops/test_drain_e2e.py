"""SIGTERM drain, end to end: an in-flight fetch completes, a new one is refused, exit 0."""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path

import grpc
import pytest
from safetensors import safe_open

from tests.conftest import RunningDaemon, run_daemon
from tests.ops.conftest import BIG_TENSOR_BYTES
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

REQUEST = pb.FetchRequest(layout=pb.Layout(tp_size=1, tp_rank=0))


def _channel(target: str) -> grpc.Channel:
    # No BDP probing: the receive window stays small, so an unread stream really stalls
    # on the daemon instead of being buffered whole on this side.
    return grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])


def _wait_for(daemon: RunningDaemon, needle: str) -> None:
    for _ in range(600):  # bounded: up to about a minute
        if needle in daemon.log():
            return
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} never appeared in the log:\n{daemon.log()}")


def test_sigterm_drains_in_flight_fetch_refuses_new_and_exits_zero(
    tmp_path: Path, big_model: Path
) -> None:
    with run_daemon(tmp_path, [("big", big_model)], ["--grace", "120"]) as daemon:
        with _channel(daemon.target) as channel:
            stub = pb_grpc.WeightsStub(channel)
            stream = stub.Fetch(REQUEST, timeout=300)
            first = next(stream)  # in flight: the daemon is blocked sending the rest
            daemon.process.send_signal(signal.SIGTERM)
            _wait_for(daemon, "drain grace_seconds=120.000 in_flight=1")

            # A new fetch is refused, on a fresh connection and on the open one.
            with _channel(daemon.target) as fresh, pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.WeightsStub(fresh).Fetch(REQUEST, timeout=30))
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Fetch(REQUEST, timeout=30))
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE

            # The in-flight one completes, every byte and its digest intact.
            data = bytearray()
            digest = ""
            done = None
            for response in [first, *stream]:
                for chunk in response.chunks:
                    data += chunk.data
                    digest = chunk.digest or digest
                if response.HasField("done"):
                    done = response.done
        assert done is not None and done.total_bytes == BIG_TENSOR_BYTES
        with safe_open(str(big_model / "model.safetensors"), framework="numpy") as f:
            expected = f.get_tensor("blob").tobytes()
        assert bytes(data) == expected
        assert digest == "sha256:" + hashlib.sha256(expected).hexdigest()
        assert daemon.process.wait(120) == 0
        assert "exit status=0 aborted=false" in daemon.log()


def test_second_signal_aborts(tmp_path: Path, big_model: Path) -> None:
    with run_daemon(tmp_path, [("big", big_model)], ["--grace", "600"]) as daemon:
        with _channel(daemon.target) as channel:
            stream = pb_grpc.WeightsStub(channel).Fetch(REQUEST, timeout=300)
            next(stream)  # held open, never read further
            daemon.process.send_signal(signal.SIGTERM)
            _wait_for(daemon, "drain grace_seconds=600.000 in_flight=1")
            daemon.process.send_signal(signal.SIGTERM)
            assert daemon.process.wait(120) == 1
            with pytest.raises(grpc.RpcError):
                for _ in stream:
                    pass
        assert "aborting in-flight RPCs now" in daemon.log()
        assert "exit status=1 aborted=true" in daemon.log()
