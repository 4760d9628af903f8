"""Slice digest kinds on the wire (``FetchRequest.slice_digest``), old and new both ways.

A client that can import ``blake3`` asks for BLAKE3 slice digests; an old client (the
generated stub, no field 7) must get the SHA-256 stream it always got, byte for byte
in meaning; a new client talking to an old daemon (which ignores field 7: played here
by a real gRPC proxy that drops the field before the daemon sees it) must accept the
SHA-256 it gets. Every fetch is compared bit for bit with slicing the checkpoint.
``--no-fetch-rehash`` serves the same bytes, and a shard rewritten in place under it
(mtime put back) is still refused by the client's own check.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon
from tests.models import expected_slice, read_checkpoint
from tests.old_daemon import without_slice_digest
from weightd.client import DataLossError, InvalidArgumentError, WeightClient
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e
WORLD = 2


@pytest.fixture(scope="module")
def daemon(
    transformers_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("kinds")
    with run_daemon(tmp, [("llama", transformers_models["llama"])], ["--chunk-bytes", "8192"]) as d:
        yield d


def _assert_exact(state: dict[str, torch.Tensor], directory: Path, rank: int) -> None:
    original = read_checkpoint(directory)
    config = json.loads((directory / "config.json").read_text())
    assert set(state) == set(original)
    for name, full in original.items():
        want = expected_slice(name, full, config, WORLD, rank).contiguous()
        got = state[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("kind", ["blake3", "sha256"])
def test_each_kind_delivers_the_exact_slices(
    daemon: RunningDaemon, transformers_models: dict[str, Path], kind: str
) -> None:
    with WeightClient(daemon.target, timeout=60, slice_digest=kind) as client:
        for rank in range(WORLD):
            _assert_exact(
                client.fetch(rank, WORLD, transport="grpc"), transformers_models["llama"], rank
            )
            assert client.last_resume is not None
            assert client.last_resume.slice_digest == kind


def test_the_client_asks_for_blake3_when_it_can() -> None:
    assert WeightClient("unix:///nonexistent.sock").slice_digest == "blake3"
    with pytest.raises(InvalidArgumentError, match="slice_digest 'md5'"):
        WeightClient("unix:///nonexistent.sock", slice_digest="md5")


def _generated_fetch(target: str, **fields: Any) -> list[pb.FetchResponse]:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.WeightsStub(channel)
        request = pb.FetchRequest(layout=pb.Layout(tp_size=WORLD, tp_rank=1), **fields)
        return list(stub.Fetch(request, timeout=60))


def test_old_client_gets_sha256_as_before(
    daemon: RunningDaemon, transformers_models: dict[str, Path]
) -> None:
    """The generated stub, parsing with protobuf, never setting field 7."""
    messages = _generated_fetch(daemon.target)
    assert not messages[0].HasField("done") and messages[0].model_fingerprint
    assert all(m.slice_digest == "" for m in messages)  # nothing new on an old stream
    slices: dict[str, bytearray] = {}
    names: dict[int, str] = {}
    digests = 0
    for m in messages:
        for c in m.chunks:
            if c.HasField("header"):
                names[c.index] = c.header.name
                slices[c.header.name] = bytearray()
            slices[names[c.index]] += c.data
            if c.digest:
                want = "sha256:" + hashlib.sha256(slices[names[c.index]]).hexdigest()
                assert c.digest == want
                digests += 1
    assert digests == len(slices) == messages[-1].done.num_tensors
    with WeightClient(daemon.target, timeout=60) as client:  # the new client, BLAKE3
        new = client.fetch(1, WORLD, transport="grpc")
    assert {n: bytes(b) for n, b in slices.items()} == {
        n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in new.items()
    }


def test_unknown_kind_is_invalid_argument(daemon: RunningDaemon) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _generated_fetch(daemon.target, slice_digest="md5")
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "slice_digest 'md5'" in (err.value.details() or "")


def test_new_client_accepts_sha256_from_an_old_daemon(
    daemon: RunningDaemon, transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    old = without_slice_digest(daemon.target, tmp_path / "old.sock")
    try:
        with WeightClient(old.target, timeout=60) as client:
            state = client.fetch(0, WORLD, transport="grpc")
            assert client.last_resume is not None
            assert client.last_resume.slice_digest == "sha256"
        assert old.requests[0].slice_digest == "blake3"  # it did ask
    finally:
        old.close()
    _assert_exact(state, transformers_models["llama"], 0)


def test_no_fetch_rehash_serves_the_same_bytes_and_the_client_still_checks(
    transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(transformers_models["llama"], model)
    extra = ["--no-fetch-rehash", "--chunk-bytes", "8192", "--watch-interval", "0"]
    with run_daemon(tmp_path, [("llama", model)], extra) as d:
        for kind in ("blake3", "sha256"):
            with WeightClient(d.target, timeout=60, slice_digest=kind) as client:
                _assert_exact(client.fetch(1, WORLD, transport="grpc"), model, 1)
        # Rewritten in place, mtime put back: the daemon's fstat check cannot see it and
        # it no longer re-hashes, so only the client's own digest check stands.
        shard = sorted(model.glob("*.safetensors"))[-1]
        st = shard.stat()
        good = shard.read_bytes()
        d.process.send_signal(signal.SIGSTOP)
        try:
            with open(shard, "r+b") as f:
                f.seek(len(good) - 64)
                f.write(bytes(b ^ 0xFF for b in good[-64:]))
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            d.process.send_signal(signal.SIGCONT)
        for kind in ("blake3", "sha256"):
            with (
                WeightClient(d.target, timeout=60, slice_digest=kind) as client,
                pytest.raises(DataLossError, match=f"hash to {kind}:"),
            ):
                client.fetch(1, WORLD, transport="grpc")


@pytest.mark.parametrize("kind", ["blake3", "sha256"])
def test_the_daemon_refuses_bytes_it_reads_into_a_message_that_no_longer_hash_right(
    transformers_models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """With the re-hash on (the default), bytes read straight into the outgoing message
    are hashed there and checked before that message exists: a shard rewritten in place
    with its mtime put back (invisible to ``fstat``; watcher off) fails the fetch at the
    daemon, whose message names its own check, and marks the model broken."""
    model = tmp_path / "model"
    shutil.copytree(transformers_models["llama"], model)
    extra = ["--chunk-bytes", "8192", "--watch-interval", "0"]
    with run_daemon(tmp_path, [("llama", model)], extra) as d:
        with WeightClient(d.target, timeout=60, slice_digest=kind) as client:
            _assert_exact(client.fetch(1, WORLD, transport="grpc"), model, 1)
        shard = sorted(model.glob("*.safetensors"))[-1]
        st = shard.stat()
        good = shard.read_bytes()
        with open(shard, "r+b") as f:
            f.seek(len(good) - 64)
            f.write(bytes(b ^ 0xFF for b in good[-64:]))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        with WeightClient(d.target, timeout=60, slice_digest=kind) as client:
            with pytest.raises(DataLossError, match=f"slice bytes read now hash to {kind}:"):
                client.fetch(1, WORLD, transport="grpc")
            (info,) = client.list_models()
            assert info.state == "broken"
