"""Slice digest kinds on the wire (``FetchRequest.slice_digest``), old and new both ways.

A client that can import ``blake3`` asks for BLAKE3 slice digests; an old client (the
generated stub, no field 7) must get the SHA-256 stream it always got, byte for byte
in meaning; a new client talking to an old daemon (which ignores field 7: played here
by a real gRPC proxy that drops the field before the daemon sees it) must accept the
SHA-256 it gets. Every fetch is compared bit for bit with slicing the checkpoint.
By default the daemon does not re-hash what it sends: a shard rewritten in place
(mtime put back) is refused by the client's own check, which then asks the daemon to
re-hash (``FetchRequest.rehash``), and the daemon refuses and marks the model broken;
bytes spoiled on the way are fetched again; an old daemon that ignores the field
leaves the client's own refusal.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon
from tests.models import expected_slice, read_checkpoint
from tests.old_daemon import (
    FieldForgettingProxy,
    corrupting_first_stream,
    without_rehash,
    without_slice_digest,
)
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


def _state(target: str) -> str:
    with WeightClient(target, timeout=60) as client:
        (info,) = client.list_models()
        return info.state


@dataclass
class _Refusal:
    streams: int
    rechecks: int
    resent_bytes: int
    error: str


def _refused(target: str, kind: str, match: str) -> _Refusal:
    """How a gRPC fetch of rank 1 that must fail with DATA_LOSS (``match``) went."""
    with WeightClient(target, timeout=60, slice_digest=kind) as client:
        with pytest.raises(DataLossError, match=match) as err:
            client.fetch(1, WORLD, transport="grpc")
        r = client.last_resume
    assert r is not None
    return _Refusal(r.streams, r.rechecks, r.resent_bytes, type(err.value).__name__)


def _rewrite_in_place(model: Path, daemon: RunningDaemon) -> None:
    """Flip the last 64 bytes of the last shard and put its mtime back (the daemon
    stopped meanwhile): invisible to the daemon's ``fstat`` checks, and to its watcher,
    which these tests switch off."""
    shard = sorted(model.glob("*.safetensors"))[-1]
    st = shard.stat()
    good = shard.read_bytes()
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        with open(shard, "r+b") as f:
            f.seek(len(good) - 64)
            f.write(bytes(b ^ 0xFF for b in good[-64:]))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        daemon.process.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("kind", ["blake3", "sha256"])
def test_by_default_the_client_checks_and_a_mismatch_makes_the_daemon_check(
    transformers_models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """The default daemon does not re-hash what it sends; the client's own check finds
    the rewritten slice, asks again with ``rehash`` from that tensor on (the ones before
    it are kept), and the daemon's check then refuses the bytes and marks the model
    broken: the error the caller gets is the daemon's."""
    model = tmp_path / "model"
    shutil.copytree(transformers_models["llama"], model)
    extra = ["--chunk-bytes", "8192", "--watch-interval", "0"]
    with run_daemon(tmp_path, [("llama", model)], extra) as d:
        proxy = FieldForgettingProxy(d.target, tmp_path / "seen.sock", lambda r: None)
        try:
            with WeightClient(proxy.target, timeout=60, slice_digest=kind) as client:
                _assert_exact(client.fetch(1, WORLD, transport="grpc"), model, 1)
                assert client.last_resume is not None and client.last_resume.rechecks == 0
            assert [r.rehash for r in proxy.requests] == [False]
            _rewrite_in_place(model, d)
            report = _refused(proxy.target, kind, f"slice bytes read now hash to {kind}:")
            assert (report.streams, report.rechecks, report.error) == (2, 1, "DataLossError")
            assert report.resent_bytes > 0  # the slice the client refused was sent again
            assert _state(d.target) == "broken"
            first, again = proxy.requests[1:]
            assert (first.rehash, first.start_index) == (False, 0)
            assert again.rehash and again.start_index > 0  # the tensors before stayed held
        finally:
            proxy.close()


def test_a_copy_that_went_bad_on_the_way_is_fetched_again_and_served(
    daemon: RunningDaemon, transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    """Bytes corrupted between a sound daemon and the client (a real gRPC hop that
    flips one byte of the first stream): the client's check refuses that tensor, the
    re-hashed second stream delivers it, and the rank is exact; the model stays ready."""
    proxy, flipped = corrupting_first_stream(daemon.target, tmp_path / "bad-hop.sock")
    try:
        with WeightClient(proxy.target, timeout=60) as client:
            state = client.fetch(1, WORLD, transport="grpc")
            report = client.last_resume
            assert report is not None
            assert (report.streams, report.rechecks) == (2, 1)
        again = proxy.requests[1]
        assert flipped == [1] and again.rehash and again.start_index == 1  # tensor 0 stayed
        assert _state(daemon.target) == "ready"
    finally:
        proxy.close()
    _assert_exact(state, transformers_models["llama"], 1)


def test_an_old_daemon_that_does_not_rehash_leaves_the_clients_own_refusal(
    transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    """A daemon from before ``FetchRequest.rehash``, run with ``--no-fetch-rehash``
    (a proxy dropping field 8 in front of a default daemon): the second stream is not
    re-hashed either, so the client refuses the slice again itself, after exactly one
    recheck, and the daemon keeps the model ready (it never looked)."""
    model = tmp_path / "model"
    shutil.copytree(transformers_models["llama"], model)
    extra = ["--chunk-bytes", "8192", "--watch-interval", "0"]
    with run_daemon(tmp_path, [("llama", model)], extra) as d:
        old = without_rehash(d.target, tmp_path / "old.sock")
        try:
            with WeightClient(old.target, timeout=60) as client:  # anchors the slices
                _assert_exact(client.fetch(1, WORLD, transport="grpc"), model, 1)
            _rewrite_in_place(model, d)
            report = _refused(old.target, "blake3", "received bytes hash to blake3:")
            assert report.error == "DigestMismatch"
            assert (report.streams, report.rechecks) == (2, 1)
            assert [r.rehash for r in old.requests] == [False, False, True]  # it did ask
            assert _state(d.target) == "ready"
        finally:
            old.close()


@pytest.mark.parametrize("kind", ["blake3", "sha256"])
def test_the_daemon_refuses_bytes_it_reads_into_a_message_that_no_longer_hash_right(
    transformers_models: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    """With ``--fetch-rehash`` (every stream re-hashed), bytes read straight into the
    outgoing message are hashed there and checked before that message exists: a shard
    rewritten in place with its mtime put back (invisible to ``fstat``; watcher off)
    fails the fetch at the daemon, on the first stream, whose message names its own
    check, and marks the model broken."""
    model = tmp_path / "model"
    shutil.copytree(transformers_models["llama"], model)
    extra = ["--fetch-rehash", "--chunk-bytes", "8192", "--watch-interval", "0"]
    with run_daemon(tmp_path, [("llama", model)], extra) as d:
        with WeightClient(d.target, timeout=60, slice_digest=kind) as client:
            _assert_exact(client.fetch(1, WORLD, transport="grpc"), model, 1)
        _rewrite_in_place(model, d)
        report = _refused(d.target, kind, f"slice bytes read now hash to {kind}:")
        assert (report.streams, report.rechecks) == (1, 0)  # refused before the client saw it
        assert _state(d.target) == "broken"
