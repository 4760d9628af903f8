"""A LoRA adapter loaded from an ``--adapter-root s3://...`` root: the same slices as
the same adapter loaded from a local root, and refused without a trust root."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from tests.adapters.conftest import BASE_CONFIG, make_adapter
from tests.conftest import run_daemon
from tests.models import build_model
from tests.s3.conftest import SeaweedS3
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient
from weightd.client.base.errors import FailedPreconditionError, InvalidArgumentError

pytestmark = pytest.mark.e2e


def _digest(directory: Path) -> str:
    """The adapter digest as docs/guides/adapters.md defines it, computed here independently."""
    lines = "".join(
        f"{n} {hashlib.sha256((directory / n).read_bytes()).hexdigest()}\n"
        for n in ("adapter_config.json", "adapter_model.safetensors")
    )
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def test_adapter_from_an_s3_root_matches_the_local_one(
    seaweed: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_dir = tmp_path / "tiny-llama"
    build_model("llama", BASE_CONFIG).save_pretrained(str(base_dir))
    root = tmp_path / "adapters"
    make_adapter(base_dir, root / "good", 1, 4)
    bucket = seaweed.bucket()
    seaweed.upload_dir(root / "good", bucket, "adapters/good/")
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    s3_root = f"s3://{bucket}/adapters/"
    extra = ["--adapter-root", str(root), "--adapter-root", s3_root]
    extra += ["--s3-endpoint", seaweed.endpoint]
    config = json.loads((base_dir / "config.json").read_text())
    assert config["num_key_value_heads"] == 2
    with run_daemon(tmp_path, [("tiny-llama", base_dir)], extra) as d:
        with AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60) as admin:
            with pytest.raises(FailedPreconditionError, match="not a trust root"):
                admin.load_adapter("remote", s3_root + "good/")
            with pytest.raises(InvalidArgumentError, match="not under an adapter root"):
                admin.load_adapter("remote", f"s3://{bucket}/elsewhere/good/")
            digest = _digest(root / "good")
            remote = admin.load_adapter("remote", s3_root + "good/", expected_digest=digest)
            local = admin.load_adapter("local", str(root / "good"))
            assert remote.digest == local.digest == digest
        with WeightClient(d.target, timeout=60) as client:
            for rank in range(2):
                a = client.fetch_adapter("remote", rank, 2, transport="grpc").tensors
                b = client.fetch_adapter("local", rank, 2, transport="grpc").tensors
                assert a.keys() == b.keys() and a
                for name, tensor in a.items():
                    assert torch.equal(tensor, b[name]), name
        assert "download phase=done" in d.log()
