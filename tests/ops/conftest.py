"""Fixtures for the operations tests: models, a test PKI, scrapes."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.ops.pki import Pki, make_pki

#: Big enough that a Fetch of it cannot fit in gRPC's and the kernel's buffers, so a
#: client that stops reading really holds the stream open on the daemon.
BIG_TENSOR_BYTES = 48 << 20


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in demo checkpoint (Llama-style, three shards), created once."""
    from weightd.server.cli.demo import ensure_demo_checkpoint

    return Path(ensure_demo_checkpoint(str(tmp_path_factory.mktemp("demo-cache"))))


@pytest.fixture(scope="session")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 48 MiB tensor of an architecture without rules (served whole at world size 1)."""
    root = tmp_path_factory.mktemp("big-model")
    (root / "config.json").write_text(json.dumps({"architectures": ["BigForTest"]}))
    rng = np.random.default_rng(7)
    data = rng.integers(0, 255, size=BIG_TENSOR_BYTES, dtype=np.uint8)
    save_file({"blob": data}, str(root / "model.safetensors"))
    return root


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def free_port() -> int:
    """A loopback port free right now (for programs that cannot report a port 0 bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as reply:  # loopback only
        assert reply.status == 200
        return str(reply.read().decode())
