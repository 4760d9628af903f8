"""Describing a model over the side socket: the gRPC ``DescribeModel``'s answer, its
refusals, and its bounds, against a real daemon out of process.

The vLLM loader on the daemon's host describes here instead of opening a gRPC channel
(``weightd.vllm.share.describe``); what it receives must be exactly what gRPC says
(the identity check and the fetch's version rest on it), a refusal must be the same
typed error, and a hostile request is bounded as every side-channel request is.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon
from weightd.client import ModelNotFound, ResourceExhaustedError, WeightClient, WeightdError
from weightd.client.transports.local import LocalConnection
from weightd.client.transports.local_describe import (
    WireError,
    decode_description,
    describe_local,
    encode_describe,
    is_not_understood,
)
from weightd.client.transports.selection import side_socket_path
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb
from weightd.vllm.share.describe import describe, description_of_wire

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def daemon(
    transformers_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    models = [(n, d) for n, d in sorted(transformers_models.items()) if n in ("llama", "qwen2")]
    with run_daemon(tmp_path_factory.mktemp("describe-daemon"), models) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(daemon.target, timeout=120) as c:
        yield c


def side(daemon: RunningDaemon) -> str:
    path = side_socket_path(daemon.target)
    assert path is not None
    return path


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_the_side_socket_describes_exactly_what_grpc_describes(
    daemon: RunningDaemon, client: WeightClient, model: str
) -> None:
    over_grpc = client.describe(model)
    assert over_grpc.files and over_grpc.tensors and over_grpc.version >= 1  # not vacuous
    for version in (0, over_grpc.version):
        local = description_of_wire(describe_local(side(daemon), model, version, timeout=60))
        assert local == over_grpc
    got, wire = describe(client, model)
    assert (got, wire) == (over_grpc, "shm")
    got, wire = describe(client, model, transport="grpc")
    assert (got, wire) == (over_grpc, "grpc")


def test_refusals_are_grpcs_typed_errors(daemon: RunningDaemon, client: WeightClient) -> None:
    cases = [("no-such-model", 0), ("llama", 999)]  # unknown model; a version not held
    for model, version in cases:
        with pytest.raises(WeightdError) as by_grpc:
            client.describe(model, version=version)
        with pytest.raises(WeightdError) as by_side:
            describe_local(side(daemon), model, version, timeout=60)
        assert type(by_side.value) is type(by_grpc.value)
        assert by_side.value.detail == by_grpc.value.detail
        assert by_side.value.transport is None  # the daemon's answer: no gRPC fallback
        # The loader's describe raises it as is: gRPC would say the same.
        with pytest.raises(type(by_grpc.value)):
            describe(client, model, version=version)
    with pytest.raises(ModelNotFound, match="no-such-model"):
        describe_local(side(daemon), "no-such-model", 0, timeout=60)


def test_a_daemon_that_predates_describe_sends_the_client_to_grpc(daemon: RunningDaemon) -> None:
    """What a daemon without ``LocalRequest.describe`` receives is a request in a field it
    does not know; this daemon's answer to one (field 19, still unassigned) is what an
    older one answers to field 10, and the client reads it as "describe over gRPC"."""
    conn = LocalConnection(side(daemon), "shm", timeout=60)
    try:
        with pytest.raises(WeightdError) as err:
            conn.exchange(b"\x9a\x01\x00")  # field 19, an empty message
    finally:
        conn.close()
    assert is_not_understood(err.value)
    with pytest.raises(ModelNotFound) as known:
        describe_local(side(daemon), "no-such-model", 0, timeout=60)
    assert not is_not_understood(known.value)


def test_an_oversized_model_name_is_refused_by_the_field_bound(daemon: RunningDaemon) -> None:
    with pytest.raises(ResourceExhaustedError) as err:
        describe_local(side(daemon), "m" * 5000, 0, timeout=60)
    assert "field describe.model is 5000 bytes" in err.value.detail
    assert "the limit is 256" in err.value.detail
    assert len(err.value.detail) < 1000  # the name is not echoed whole
    # The daemon still answers after it.
    assert describe_local(side(daemon), "llama", 0, timeout=60).name == "llama"


def test_a_request_over_the_frame_limit_is_not_sent(daemon: RunningDaemon) -> None:
    conn = LocalConnection(side(daemon), "shm", timeout=60)
    try:
        with pytest.raises(ResourceExhaustedError, match="the daemon reads at most"):
            conn.exchange(encode_describe("x" * (2 << 20), 0))
    finally:
        conn.close()


def test_the_hand_codec_is_protobufs() -> None:
    """Every field both ways through the generated classes, a negative int64 included."""
    request = lpb.LocalRequest(describe=pb.DescribeModelRequest(model="m\u00e9", version=7))
    assert encode_describe("m\u00e9", 7) == request.SerializeToString()
    assert (
        encode_describe("", 0)
        == lpb.LocalRequest(describe=pb.DescribeModelRequest()).SerializeToString()
    )
    message = pb.ModelDescription(
        name="m",
        architecture="LlamaForCausalLM",
        config_json='{"a": 1}',
        total_bytes=1 << 40,
        model_fingerprint="fp",
        host_boot_id="boot",
        version=3,
        trust_root="manifest:ed25519:0123",
    )
    message.tensors.add(
        name="w",
        dtype="BF16",
        shape=[3, 1 << 33],
        shard="a.safetensors",
        nbytes=12,
        digest="blake3:ab",
    )
    message.tensors.add(name="scalar", dtype="F32")
    message.files.add(
        name="a.safetensors",
        size=9,
        sha256="cd",
        device=1 << 40,
        inode=5,
        mtime_ns=-1_500_000_000,
        sample_digest="s",
    )
    wire = decode_description(
        lpb.LocalResponse(description=message).description.SerializeToString()
    )
    from weightd.client.api.descriptions import description_of

    assert description_of_wire(wire) == description_of(message)
    assert description_of_wire(wire).files[0].mtime_ns == -1_500_000_000
    for broken in (b"\x0a\xff", b"\x22\x05\x0a\x01", b"\x28"):  # overlong, truncated
        with pytest.raises(WireError):
            decode_description(broken)
