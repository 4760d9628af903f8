"""DescribeModel says which files the daemon verified, and the content's fingerprint.

A client holding a local copy of the checkpoint (vLLM's model directory) proves it is
the served one with these: the SHA-256 of config.json and of the index, every file's
size, and the fingerprint that Fetch streams name.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
import pytest

from tests.conftest import run_daemon
from weightd.server.cli.demo import ensure_demo_checkpoint
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e


def test_describe_lists_every_verified_file_and_the_fingerprint(tmp_path: Path) -> None:
    model = Path(ensure_demo_checkpoint(str(tmp_path / "demo")))
    with (
        run_daemon(tmp_path, [("demo", model)]) as daemon,
        grpc.insecure_channel(daemon.target) as channel,
    ):
        stub = pb_grpc.WeightsStub(channel)
        desc = stub.DescribeModel(pb.DescribeModelRequest(model="demo"), timeout=60)
        first = next(iter(stub.Fetch(pb.FetchRequest(model="demo", layout=pb.Layout(tp_size=1)))))
    files = {f.name: f for f in desc.files}
    on_disk = {p.name for p in model.iterdir() if p.suffix in (".json", ".safetensors")}
    assert set(files) == on_disk
    for name, f in files.items():
        data = (model / name).read_bytes()
        assert f.size == len(data), name
        if name.endswith(".json"):
            assert f.sha256 == hashlib.sha256(data).hexdigest(), name
        else:
            assert f.sha256 in ("", hashlib.sha256(data).hexdigest()), name
    assert desc.model_fingerprint and desc.model_fingerprint == first.model_fingerprint
