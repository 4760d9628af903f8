"""An older client's requests, as its bytes were, still served by today's daemon.

The requests are written here by hand, field number by field number, with only the
fields the first clients knew (no version, no slice digest kind, no pipeline or expert
sizes, no vocabulary padding): what today's generated classes would write can change
with the proto, these bytes cannot. A real daemon out of process answers them over
gRPC (raw method calls, no weightd client) and over the side socket.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.message import Message

from tests.conftest import RunningDaemon, run_daemon
from tests.models import VERSIONED_LLAMA, build_model, expected_slice, read_checkpoint
from weightd.common.frames import recv_frame, send_frame
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

pytestmark = pytest.mark.e2e

CONFIG = VERSIONED_LLAMA
WEIGHTS = "/weightd.v1.Weights/"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def uint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def length(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


#: ``Layout{tp_size: 2, tp_rank: 1}``: tensor parallelism, all the first clients knew.
OLD_LAYOUT = uint(1, 2) + uint(2, 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("old-client") / "m"
    build_model("llama", CONFIG, seed=1).save_pretrained(directory, max_shard_size="40KB")
    return directory


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[RunningDaemon]:
    with run_daemon(tmp_path_factory.mktemp("daemon"), [("m", checkpoint)]) as d:
        yield d


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def test_an_old_fetch_request_streams_the_rank_as_it_always_did(
    daemon: RunningDaemon, checkpoint: Path
) -> None:
    request = length(1, b"m") + length(2, OLD_LAYOUT) + uint(4, 8192)  # model, layout, chunk
    with grpc.insecure_channel(daemon.target) as channel:
        fetch = channel.unary_stream(
            WEIGHTS + "Fetch",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.FetchResponse.FromString,
        )
        messages = list(fetch(request, timeout=60))
    first = messages[0]
    assert first.model_fingerprint and not first.chunks
    assert first.slice_digest == "" and first.vocab_pad == 0  # named only to who asks
    names: dict[int, str] = {}
    data: dict[int, bytearray] = {}
    digests: dict[int, str] = {}
    for m in messages[1:]:
        for c in m.chunks:
            if c.HasField("header"):
                names[c.index] = c.header.name
            assert c.offset == len(data.setdefault(c.index, bytearray()))
            data[c.index] += c.data
            if c.digest:
                digests[c.index] = c.digest
    assert messages[-1].done.num_tensors == len(names)
    full = read_checkpoint(checkpoint)
    assert sorted(names.values()) == sorted(full)
    for index, name in names.items():
        assert bytes(data[index]) == raw_bytes(expected_slice(name, full[name], CONFIG, 2, 1))
        assert digests[index] == "sha256:" + hashlib.sha256(data[index]).hexdigest()


def test_old_describe_and_hold_requests_are_answered(daemon: RunningDaemon) -> None:
    with grpc.insecure_channel(daemon.target) as channel:

        def call(method: str, request: bytes, reply: type[Message]) -> Message:
            stub = channel.unary_unary(
                WEIGHTS + method,
                request_serializer=lambda raw: raw,
                response_deserializer=reply.FromString,
            )
            got: Message = stub(request, timeout=60)
            return got

        described = call("DescribeModel", length(1, b"m"), pb.ModelDescription)
        assert isinstance(described, pb.ModelDescription)
        assert described.name == "m" and described.version == 1 and described.tensors
        hold = call(
            "HoldVersion", length(1, b"m") + length(3, b"old") + uint(4, 30), pb.HoldVersionResponse
        )
        assert isinstance(hold, pb.HoldVersionResponse)
        assert hold.hold_id and hold.version.version == 1 and hold.ttl_seconds == 30
        released = call(
            "ReleaseVersion", length(1, hold.hold_id.encode()), pb.ReleaseVersionResponse
        )
        assert isinstance(released, pb.ReleaseVersionResponse) and released.released


def test_an_old_side_socket_request_gets_a_sha256_grant(daemon: RunningDaemon) -> None:
    acquire = length(1, b"m") + length(2, OLD_LAYOUT) + uint(4, lpb.PLACEMENT_HOST)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    try:
        sock.connect(daemon.target.removeprefix("unix://") + ".local")
        recv_frame(sock)  # hello
        send_frame(sock, length(1, acquire))  # LocalRequest{acquire}
        got = recv_frame(sock, 4)
        assert got is not None, "the daemon closed the side socket"
        payload, fds = got
        for fd in fds:
            os.close(fd)
    finally:
        sock.close()
    response = lpb.LocalResponse.FromString(payload)
    assert response.WhichOneof("response") == "grant", response
    grant = response.grant
    assert grant.entries and all(e.digest.startswith("sha256:") for e in grant.entries)
