"""The loader's conversation on the daemon's host goes over the side socket alone.

``worker_share`` is what a vLLM worker running ``load_format="weightd"`` does before
vLLM copies the weights into its parameters: describe the model, prove the model
directory is that checkpoint, fetch the rank's share. On the daemon's host nothing of
it may need gRPC: run in a fresh process (no vLLM: the conversation does not need
it), no ``grpc`` module and none of the generated classes may be imported at the end,
and the share must be the daemon's, proven file by file. Asked for ``transport:
"grpc"``, the same process does import gRPC: the check can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon

pytestmark = pytest.mark.e2e

WORKER = """
import json, sys
from pathlib import Path

import torch

from weightd.client import Layout
from weightd.vllm.loader.model_loader import worker_share
from weightd.vllm.loader.options import parse_options

directory, target, transport = sys.argv[1:4]
options = parse_options({"target": target, "model": "llama", "transport": transport})
layout = Layout(tp_size=1, tp_rank=0)
weights, report = worker_share(Path(directory), layout, torch.nn.Module(), options)
print(json.dumps({
    "grpc": sorted(m for m in sys.modules if m == "grpc" or m.startswith("grpc.")),
    "generated": sorted(m for m in sys.modules if m.startswith("weightd.v1.")),
    "described_over": report.described_over,
    "transport": report.transport,
    "identity": report.identity,
    "steps": sorted(report.steps),
    "tensors": len(weights),
    "shapes": {n: list(t.shape) for n, t in weights},
}))
"""


@pytest.fixture(scope="module")
def daemon(
    transformers_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    models = [("llama", transformers_models["llama"])]
    # Declared, as a deployment declares what its engines load: the packs are built
    # before SERVING (an undeclared one being built is served over gRPC meanwhile).
    layouts = ["--layout", "tp=1"]
    with run_daemon(tmp_path_factory.mktemp("side-daemon"), models, layouts) as d:
        yield d


def run_worker(directory: Path, daemon: RunningDaemon, transport: str) -> dict[str, object]:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WORKER,
            str(directory),
            daemon.target,
            transport,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return out


def test_the_same_host_conversation_imports_no_grpc(
    transformers_models: dict[str, Path], daemon: RunningDaemon
) -> None:
    """TP=1: above it the vocabulary cut reads vLLM's layers (``share/vocab.py``), so a
    TP=2 worker is a vLLM process; the conversation is the same one, other layout."""
    got = run_worker(transformers_models["llama"], daemon, "auto")
    assert got["grpc"] == []
    assert got["generated"] == []
    assert got["described_over"] == "shm"
    assert got["transport"] == "shm"
    identity = got["identity"]
    assert isinstance(identity, dict) and identity
    assert set(identity.values()) == {"same file"}
    assert got["steps"] == ["describe", "fetch", "identity"]
    assert isinstance(got["tensors"], int) and got["tensors"] > 0


def test_asked_for_grpc_the_same_conversation_imports_it(
    transformers_models: dict[str, Path], daemon: RunningDaemon
) -> None:
    got = run_worker(transformers_models["llama"], daemon, "grpc")
    assert "grpc" in got["grpc"]  # type: ignore[operator]
    assert got["described_over"] == "grpc"
    assert got["transport"] == "grpc"
