"""The daemon restarts under a fetching client: SIGKILL mid-stream, SIGTERM drain,
and a restart on changed content.

The client (``WeightClient`` with a :class:`RetryPolicy`) sees UNAVAILABLE while the
daemon is away, backs off and retries; a stream cut mid-way resumes from the last
tensor it received completely, which the *new* daemon confirms in its log (the
stream's start index), and the result is bit-identical to slices cut from the files.

To cut the stream at a known place, ``on_tensor`` (the client's progress callback)
blocks the receiving thread after tensor :data:`PAUSE_AT` until the test has killed
and restarted the daemon.
"""

from __future__ import annotations

import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from bench.loadgen import reference_slices
from tests.conftest import RunningDaemon, run_daemon
from tests.models import spy_load_state_dict
from tests.reliability.load_support import many_tensor_model, write_many_tensor_model
from weightd.client import RetryPolicy, WeightClient
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

__all__ = ["many_tensor_model"]  # a fixture, used by name

pytestmark = pytest.mark.e2e

PAUSE_AT = 20
WORLD, RANK = 2, 1
POLICY = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, total_seconds=120)
#: Small messages, no BDP probing: the client cannot have buffered the whole rank.
OPTIONS = [("grpc.http2.bdp_probe", 0)]


class Pause:
    """A progress callback that stops the receiving thread once, after tensor ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.reached = threading.Event()
        self.go = threading.Event()

    def __call__(self, index: int, name: str) -> None:
        if index == self.at and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(120), "the test never let the fetch go on"


def _fetch_in_thread(
    client: WeightClient, out: dict[str, Any], module: torch.nn.Module | None = None
) -> threading.Thread:
    """Fetch the rank over gRPC; or, given ``module``, load it into it in place."""

    def run() -> None:
        try:
            if module is None:
                out["state"] = client.fetch(RANK, WORLD, transport="grpc")
            else:
                client.load_into(module, RANK, WORLD, transport="grpc", in_place=True)
                out["state"] = module.state_dict()
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def _bit_exact(state: dict[str, torch.Tensor], model_dir: Path) -> None:
    want = reference_slices(str(model_dir), WORLD, RANK)
    assert set(state) == set(want)
    for name, w in want.items():
        assert torch.equal(state[name].view(torch.uint8), w.view(torch.uint8)), name


def _resumed_lines(daemon: RunningDaemon) -> list[tuple[int, int]]:
    return [
        (int(m.group(1)), int(m.group(2)))
        for m in re.finditer(r"fetch resumed model=\S+ start_index=(\d+) num_tensors=(\d+)",
                             daemon.log())
    ]  # fmt: skip


def _restart_mid_stream(
    tmp_path: Path,
    model: Path,
    between: Callable[[], None] = lambda: None,
    module: torch.nn.Module | None = None,
) -> tuple[WeightClient, dict[str, Any], RunningDaemon]:
    """Fetch; SIGKILL the daemon after tensor PAUSE_AT; ``between()``; start it again."""
    pause = Pause(PAUSE_AT)
    models = [("many", model)]
    with run_daemon(tmp_path, models) as first:
        client = WeightClient(
            first.target, timeout=120, retry=POLICY, on_tensor=pause, chunk_bytes=16 << 10,
            options=OPTIONS,
        )  # fmt: skip
        out: dict[str, Any] = {}
        thread = _fetch_in_thread(client, out, module)
        assert pause.reached.wait(120), out
        first.process.send_signal(signal.SIGKILL)
        assert first.process.wait(30) == -signal.SIGKILL
    between()
    second_cm = run_daemon(tmp_path, models)
    second = second_cm.__enter__()
    try:
        pause.go.set()
        thread.join(180)
        assert not thread.is_alive()
    except BaseException:
        second_cm.__exit__(None, None, None)
        raise
    out["daemon_cm"] = second_cm
    return client, out, second


def test_sigkill_mid_stream_resumes_from_the_last_complete_tensor(
    many_tensor_model: Path, tmp_path: Path
) -> None:
    client, out, second = _restart_mid_stream(tmp_path, many_tensor_model)
    try:
        assert "error" not in out, out.get("error")
        state = out["state"]
        _bit_exact(state, many_tensor_model)
        report = client.last_resume
        assert report is not None
        # One resume, after at least the tensors the client had when it paused.
        assert len(report.resumed_at) == 1 and report.restarts == 0, report
        start = report.resumed_at[0]
        assert PAUSE_AT + 1 <= start < len(state), report
        # The new daemon's own account: one stream, starting exactly there.
        assert _resumed_lines(second) == [(start, len(state))], second.log()
        # Sent twice: at most the tensor that was in flight, never the whole rank.
        biggest = max(t.numel() * t.element_size() for t in state.values())
        total = sum(t.numel() * t.element_size() for t in state.values())
        assert report.resent_bytes <= biggest
        assert report.received_bytes == total + report.resent_bytes
        assert client.retry_stats.retries["UNAVAILABLE"] >= 1, client.retry_stats
        print(f"\nresumed at tensor {start} of {len(state)}; re-sent {report.resent_bytes} of "
              f"{total} bytes; retries {dict(client.retry_stats.retries)}, waited "
              f"{client.retry_stats.waited_seconds:.2f} s")  # fmt: skip

        # The resume fields are checked by the daemon: past the rank is INVALID_ARGUMENT.
        with grpc.insecure_channel(second.target) as channel:
            request = pb.FetchRequest(
                model="many", layout=pb.Layout(tp_size=WORLD, tp_rank=RANK),
                start_index=len(state) + 1,
            )  # fmt: skip
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.WeightsStub(channel).Fetch(request, timeout=30))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"start_index {len(state) + 1} is past" in (info.value.details() or "")
    finally:
        client.close()
        out["daemon_cm"].__exit__(None, None, None)


def _module_like(model_dir: Path) -> torch.nn.Module:
    """A module with a parameter per tensor of the rank, filled with bytes nobody sends."""
    from bench.load_into import module_for

    want = reference_slices(str(model_dir), WORLD, RANK)
    module: torch.nn.Module = module_for(
        {n: [str(t.dtype).split(".")[1], list(t.shape)] for n, t in want.items()}
    )
    for p in module.parameters():
        p.view(torch.uint8).fill_(0xA5)
    return module


def test_in_place_load_resumes_into_the_same_parameters(
    many_tensor_model: Path, tmp_path: Path
) -> None:
    """``load_into`` receiving into the module's own memory: the tensor cut in flight
    is written again from its start, into the same parameter, and checked."""
    module = _module_like(many_tensor_model)
    storage = {n: t.data_ptr() for n, t in module.state_dict().items()}
    calls = spy_load_state_dict(module)
    client, out, _ = _restart_mid_stream(tmp_path, many_tensor_model, module=module)
    try:
        assert "error" not in out, out.get("error")
        _bit_exact(out["state"], many_tensor_model)
        assert {n: t.data_ptr() for n, t in module.state_dict().items()} == storage
        assert calls == [set()]  # every slice was received in place: torch copied none
        report = client.last_resume
        assert report is not None and len(report.resumed_at) == 1, report
        assert PAUSE_AT + 1 <= report.resumed_at[0] < len(storage), report
    finally:
        client.close()
        out["daemon_cm"].__exit__(None, None, None)


@pytest.mark.parametrize("in_place", [False, True], ids=["fetch", "load_into-in-place"])
def test_resume_against_changed_content_restarts_from_zero(
    many_tensor_model: Path, tmp_path: Path, in_place: bool
) -> None:
    """In place too: the tensors already written with the old content are all written
    again, so the module never mixes versions."""
    model = tmp_path / "model"
    shutil.copytree(many_tensor_model, model)

    def replace_checkpoint() -> None:  # same names and shapes, other bytes
        shutil.rmtree(model)
        write_many_tensor_model(model, seed=99)

    module = _module_like(many_tensor_model) if in_place else None
    client, out, second = _restart_mid_stream(tmp_path, model, replace_checkpoint, module)
    try:
        assert "error" not in out, out.get("error")
        _bit_exact(out["state"], model)  # entirely the new content, nothing of the old
        report = client.last_resume
        assert report is not None
        assert len(report.resumed_at) == 1 and report.restarts == 1, report
        # Everything received before the change was thrown away and fetched again.
        assert report.resent_bytes >= report.resumed_at[0]
        assert _resumed_lines(second) == [], "the daemon must not serve a mixed resume"
        assert "ABORTED" not in second.log()  # a refusal is a normal answer, not an error
    finally:
        client.close()
        out["daemon_cm"].__exit__(None, None, None)


def test_sigterm_drain_completes_the_stream_then_clients_retry_until_restart(
    many_tensor_model: Path, tmp_path: Path
) -> None:
    pause = Pause(PAUSE_AT)
    models = [("many", many_tensor_model)]
    with run_daemon(tmp_path, models, ["--grace", "60"]) as first:
        client = WeightClient(
            first.target, timeout=120, retry=POLICY, on_tensor=pause, chunk_bytes=16 << 10,
            options=OPTIONS,
        )  # fmt: skip
        out: dict[str, Any] = {}
        thread = _fetch_in_thread(client, out)
        assert pause.reached.wait(120)
        first.process.send_signal(signal.SIGTERM)
        pause.go.set()  # the drain lets the in-flight stream finish
        thread.join(120)
        assert "error" not in out, out.get("error")
        _bit_exact(out["state"], many_tensor_model)
        assert client.last_resume is not None and client.last_resume.streams == 1
        assert first.process.wait(60) == 0
    # The daemon is gone: a new fetch sees UNAVAILABLE and retries until it is back.
    retries_before = client.retry_stats.retries["UNAVAILABLE"]
    out2: dict[str, Any] = {}
    thread = _fetch_in_thread(client, out2)
    with run_daemon(tmp_path, models):
        thread.join(180)
        assert "error" not in out2, out2.get("error")
    _bit_exact(out2["state"], many_tensor_model)
    assert client.retry_stats.retries["UNAVAILABLE"] > retries_before, client.retry_stats
    client.close()


def test_explicit_shared_memory_fetch_retries_until_the_daemon_is_back(
    many_tensor_model: Path, tmp_path: Path
) -> None:
    """``transport="shm"`` never falls back to gRPC: the client retries the whole fetch."""
    models = [("many", many_tensor_model)]
    with run_daemon(tmp_path, models) as first:
        target = first.target
    assert first.process.returncode == 0  # drained and gone: no socket, no side socket
    client = WeightClient(target, timeout=120, retry=POLICY)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = client.fetch_with_info(RANK, WORLD, transport="shm", copy=True)
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while client.retry_stats.retries["UNAVAILABLE"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.retry_stats.retries["UNAVAILABLE"] >= 1, (client.retry_stats, out)
        assert thread.is_alive(), out  # still retrying, not given up
        with run_daemon(tmp_path, models):
            thread.join(180)
            assert not thread.is_alive()
    finally:
        thread.join(1)
        client.close()
    assert "error" not in out, out.get("error")
    state, info = out["result"]
    assert info.transport == "shm", info
    _bit_exact(state, many_tensor_model)
