"""A trainer publishes from memory: sealed shared memory on the host, gRPC from elsewhere.

A real daemon out of process, the real client, trainers as real processes where they
die mid-publish. After every refusal: the version number is unchanged, the serving
version still serves its bytes, and no memfd of the failed publish is left in the
daemon (``/proc/<pid>/fd``: the trainer's memfds are named ``weightd-trainer``, the
daemon's own stream buffers ``weightd-publish``; packs carry their layout's label).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon, weightd_command
from tests.models import VERSIONED_LLAMA, build_model, expected_slice, read_checkpoint
from weightd.client import AdminClient, Layout, WeightClient
from weightd.client.api.addresses import unix_path
from weightd.client.api.publishing import (
    SIDE_SUFFIX,
    memfd_of,
    publish_fd,
    raw_tensors,
)
from weightd.client.base.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
    WeightdError,
)
from weightd.common.frames import recv_frame, send_frame
from weightd.v1 import local_pb2 as lpb

pytestmark = pytest.mark.e2e

CONFIG = VERSIONED_LLAMA
MEMFD_NAMES = ("weightd-trainer", "weightd-publish")


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    out = {}
    for seed in (1, 2, 3):
        directory = root / f"v{seed}"
        build_model("llama", CONFIG, seed=seed).save_pretrained(directory, max_shard_size="40KB")
        out[f"v{seed}"] = directory
    return out


@pytest.fixture
def daemon(tmp_path: Path, versions: dict[str, Path]) -> Iterator[RunningDaemon]:
    with run_daemon(tmp_path, [("m", versions["v1"])]) as d:
        yield d


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory, versions: dict[str, Path]
) -> Iterator[RunningDaemon]:
    """One daemon for the refusals: none of them may change its state."""
    with run_daemon(tmp_path_factory.mktemp("shared"), [("m", versions["v1"])]) as d:
        yield d


def admin_of(d: RunningDaemon) -> AdminClient:
    return AdminClient(d.address("admin"), timeout=120)


def side_of(d: RunningDaemon) -> str:
    path = unix_path(d.address("admin"))
    assert path is not None
    return path + SIDE_SUFFIX


def memfds(pid: int) -> list[str]:
    """The daemon's descriptors that are a publish's memfds (by their names)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if any(link.startswith(f"/memfd:{n}") for n in MEMFD_NAMES):
            out.append(link)
    return out


def wait_for(check: object, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not callable(check) or not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:g} s: {what}")
        time.sleep(0.05)


def check_version(d: RunningDaemon, version: int, directory: Path) -> None:
    """``d`` serves ``version``, with ``directory``'s bytes (a whole rank of TP=2)."""
    full = read_checkpoint(directory)
    with WeightClient(d.target, timeout=60) as client:
        assert client.describe("m").version == version
        got = client.fetch_layout(Layout(tp_size=2, tp_rank=1), model="m", transport="grpc")
    assert set(got) == set(full)
    for name, tensor in got.items():
        assert torch.equal(tensor, expected_slice(name, full[name], CONFIG, 2, 1)), name


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_trainer_publishes_from_memory(
    daemon: RunningDaemon, versions: dict[str, Path], transport: str
) -> None:
    trainer = read_checkpoint(versions["v2"])  # the trainer's tensors, in memory
    with admin_of(daemon) as admin:
        published = admin.publish_tensors(trainer, model="m", transport=transport)
        assert (published.model, published.version) == ("m", 2)
        assert published.source == "memory://m"
        assert published.num_tensors == len(trainer)
        with WeightClient(daemon.target, timeout=60) as client:
            for how in ("grpc", "shm"):
                got = client.fetch(0, 1, model="m", transport=how)
                assert set(got) == set(trainer)
                for name, tensor in got.items():
                    assert torch.equal(tensor, trainer[name]), (how, name)
        # the version lives in the memfd: the trainer's own on shm, the daemon's on gRPC
        name = "weightd-trainer" if transport == "shm" else "weightd-publish"
        held = memfds(daemon.process.pid)
        assert len(held) == 1 and held[0].startswith(f"/memfd:{name}"), held
        # no files behind it: a reload refuses rather than going back to older weights
        with pytest.raises(FailedPreconditionError, match="trainer's memory") as caught:
            admin.reload("m")
        assert caught.value.reason == "NoSourceToReload"
        check_version(daemon, 2, versions["v2"])
        # a directory again: the model follows it, the memory version goes with its memfd
        assert admin.publish(str(versions["v3"]), model="m").version == 3
        wait_for(lambda: not memfds(daemon.process.pid), "the memory version's memfd closed")
        assert admin.reload("m").num_tensors == len(trainer)


def _mismatches(good: dict[str, torch.Tensor]) -> list[tuple[str, dict[str, torch.Tensor], str]]:
    name = "model.layers.0.mlp.down_proj.weight"
    t = good[name]
    other = torch.float16 if t.dtype != torch.float16 else torch.float32
    return [
        ("shape", {**good, name: t[:, :-1].clone()}, rf"{name}' has shape \[64, 127\]"),
        ("dtype", {**good, name: t.to(other)}, rf"{name}' has dtype F(16|32), expected"),
        ("missing", {k: v for k, v in good.items() if k != name}, rf"{name}' is missing"),
        ("extra", {**good, "model.extra.weight": t}, "'model.extra.weight' is not a tensor"),
    ]


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_tensors_unlike_the_serving_version_are_refused(
    shared: RunningDaemon, versions: dict[str, Path], transport: str
) -> None:
    good = read_checkpoint(versions["v2"])
    with admin_of(shared) as admin:
        for kind, tensors, message in _mismatches(good):
            with pytest.raises(InvalidArgumentError, match=message) as caught:
                admin.publish_tensors(tensors, model="m", transport=transport)
            e = caught.value
            assert e.reason == "PublishRefused", kind
            assert e.metadata["tensor"] in (
                "model.layers.0.mlp.down_proj.weight",
                "model.extra.weight",
            )
            assert e.metadata["got"] and e.metadata["expected"], kind
            check_version(shared, 1, versions["v1"])
            assert memfds(shared.process.pid) == [], kind


def test_an_unsealed_memfd_is_refused(shared: RunningDaemon, versions: dict[str, Path]) -> None:
    raws = raw_tensors(read_checkpoint(versions["v2"]))
    fd, size = memfd_of(raws, seal=False)
    try:
        with pytest.raises(InvalidArgumentError, match=r"not sealed .*F_SEAL_WRITE"):
            publish_fd(side_of(shared), fd, size, "m", timeout=60)
    finally:
        os.close(fd)
    check_version(shared, 1, versions["v1"])
    assert memfds(shared.process.pid) == []


def _hand_over(path: str, fds: list[int], size: int) -> lpb.LocalResponse:
    """The admin side socket's exchange, by hand, sending ``fds`` with the memfd request."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(path)
        assert recv_frame(sock) is not None  # hello
        ask = lpb.LocalRequest(publish=lpb.PublishTensors(model="m", nbytes=size))
        send_frame(sock, ask.SerializeToString())
        got = recv_frame(sock)
        assert got is not None
        assert lpb.LocalResponse.FromString(got[0]).WhichOneof("response") == "publish_ready"
        hand = lpb.LocalRequest(publish_memfd=lpb.PublishMemfd(nbytes=size))
        send_frame(sock, hand.SerializeToString(), fds)
        got = recv_frame(sock)
        assert got is not None
        return lpb.LocalResponse.FromString(got[0])


def test_more_than_one_descriptor_is_refused(
    shared: RunningDaemon, versions: dict[str, Path]
) -> None:
    raws = raw_tensors(read_checkpoint(versions["v2"]))
    fd, size = memfd_of(raws)
    try:
        answer = _hand_over(side_of(shared), [fd, fd, fd], size)
    finally:
        os.close(fd)
    assert answer.WhichOneof("response") == "error"
    assert answer.error.reason == "PublishRefused"
    assert "more than one descriptor" in answer.error.detail
    check_version(shared, 1, versions["v1"])
    assert memfds(shared.process.pid) == []


def test_the_worker_side_socket_refuses_a_publish(
    shared: RunningDaemon, versions: dict[str, Path]
) -> None:
    worker = unix_path(shared.target)
    assert worker is not None
    raws = raw_tensors(read_checkpoint(versions["v2"]))
    fd, size = memfd_of(raws)
    try:
        with pytest.raises(PermissionDeniedError, match="admin request") as caught:
            publish_fd(worker + ".local", fd, size, "m", timeout=60)
    finally:
        os.close(fd)
    assert caught.value.reason == "AdminOnly"
    check_version(shared, 1, versions["v1"])
    assert memfds(shared.process.pid) == []


def test_an_oversized_announcement_is_refused_before_any_descriptor(
    shared: RunningDaemon,
) -> None:
    with pytest.raises(InvalidArgumentError, match="more than a version of it can hold"):
        publish_fd(side_of(shared), -1, 1 << 40, "m", timeout=60)


_TRAINER = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    sys.path[:0] = {path!r}
    from tests.models import read_checkpoint
    from weightd.client import AdminClient
    from weightd.client.api.publishing import chunks_of, memfd_of, raw_tensors
    from weightd.common.frames import recv_frame, send_frame
    from weightd.v1 import local_pb2 as lpb

    from pathlib import Path
    raws = raw_tensors(read_checkpoint(Path({source!r})))
    if {how!r} == "grpc":
        admin = AdminClient({admin!r})

        def stalled():
            for i, chunk in enumerate(chunks_of(raws, "m", chunk_bytes=4096)):
                if i == 2:
                    print("streaming", flush=True)
                    time.sleep(3600)  # killed here, mid-stream
                yield chunk

        admin._stub.PublishTensors(stalled())
    else:
        fd, size = memfd_of(raws)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect({side!r})
        recv_frame(sock)
        send_frame(sock, lpb.LocalRequest(
            publish=lpb.PublishTensors(model="m", nbytes=size)).SerializeToString())
        recv_frame(sock)
        frame = lpb.LocalRequest(publish_memfd=lpb.PublishMemfd(nbytes=size)).SerializeToString()
        # the descriptor rides with the frame's first bytes; the trainer dies before the rest
        data = len(frame).to_bytes(4, "big") + frame
        socket.send_fds(sock, [data[:3]], [fd])
        os.close(fd)
        print("handed", flush=True)
        time.sleep(3600)  # killed here, mid-hand-over
    """
)


@pytest.mark.parametrize("how", ["grpc", "shm"])
def test_a_trainer_killed_mid_publish_publishes_nothing(
    shared: RunningDaemon, versions: dict[str, Path], how: str
) -> None:
    root = Path(__file__).resolve().parents[2]
    script = _TRAINER.format(
        path=[str(root)],
        source=str(versions["v2"]),
        how=how,
        admin=shared.address("admin"),
        side=side_of(shared),
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None
        line = trainer.stdout.readline().strip()
        assert line in ("streaming", "handed"), line
        # the daemon holds the publish's memfd while the trainer is alive
        wait_for(lambda: bool(memfds(shared.process.pid)), "the daemon holds the memfd")
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
    wait_for(lambda: not memfds(shared.process.pid), "the failed publish's memfd closed")
    check_version(shared, 1, versions["v1"])
    assert shared.process.poll() is None


def test_cli_publishes_tensors_from_files(daemon: RunningDaemon, versions: dict[str, Path]) -> None:
    shards = sorted(str(p) for p in versions["v2"].glob("*.safetensors"))
    proc = subprocess.run(
        weightd_command(
            "publish", "--tensors", *shards, "--model", "m", "--admin", daemon.address("admin")
        ),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("published m version 2 from memory"), proc.stdout
    check_version(daemon, 2, versions["v2"])


def test_a_trainer_error_is_typed(shared: RunningDaemon) -> None:
    with admin_of(shared) as admin, pytest.raises(WeightdError, match="not served here"):
        admin.publish_tensors({"x": torch.zeros(2)}, model="nope", transport="shm")


def test_the_worker_listener_refuses_the_publish_stream(
    shared: RunningDaemon, versions: dict[str, Path]
) -> None:
    tensors = read_checkpoint(versions["v2"])
    with (
        AdminClient(shared.target, timeout=60) as wrong,
        pytest.raises(PermissionDeniedError, match="admin RPC") as caught,
    ):
        wrong.publish_tensors(tensors, model="m", transport="grpc")
    assert caught.value.reason == "AdminOnly"
    check_version(shared, 1, versions["v1"])
