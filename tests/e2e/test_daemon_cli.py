"""The daemon as an operator meets it: demo checkpoint, start-up failures, signals."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import run_daemon, weightd_command
from weightd.client import WeightClient

pytestmark = pytest.mark.e2e


def _tree_digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_demo_checkpoint_is_deterministic_and_loads_in_transformers(tmp_path: Path) -> None:
    import transformers

    from weightd.server.cli.demo import ensure_demo_checkpoint

    a = Path(ensure_demo_checkpoint(str(tmp_path / "a")))
    b = Path(ensure_demo_checkpoint(str(tmp_path / "b")))
    assert _tree_digest(a) == _tree_digest(b)
    assert (a / "model.safetensors.index.json").exists()
    assert len(list(a.glob("*.safetensors"))) > 1
    model = transformers.AutoModelForCausalLM.from_pretrained(a)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_serve_without_model_serves_the_demo(tmp_path: Path) -> None:
    with run_daemon(tmp_path, []) as daemon:
        with WeightClient(daemon.target, timeout=60) as client:
            (info,) = client.list_models()
            assert info.name == "llama-demo" and info.ready
            state = client.fetch(rank=1, world_size=4)
            q = state["model.layers.0.self_attn.q_proj.weight"]
            assert q.shape == (64, 256) and q.dtype == torch.bfloat16
        assert "serving models=llama-demo" in daemon.log()


def test_client_imports_and_fetches_without_server_dependencies(tmp_path: Path) -> None:
    """A worker needs only grpcio, protobuf and torch: block everything else and fetch."""
    with run_daemon(tmp_path, []) as daemon:
        script = textwrap.dedent(
            f"""
            import sys
            for blocked in ("numpy", "blake3", "safetensors", "grpc_health", "transformers",
                            "weightd.server"):
                sys.modules[blocked] = None  # any import of these now fails
            from weightd.client import WeightClient
            client = WeightClient({daemon.target!r})
            assert client.slice_digest == "sha256", client.slice_digest  # no blake3 here
            state = client.fetch(0, 2)
            assert len(state) == 39, len(state)
            assert "numpy" not in {{m for m, v in sys.modules.items() if v is not None}}
            print("ok", sum(t.numel() for t in state.values()))
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("ok ")


def test_a_same_host_fetch_imports_neither_grpc_nor_protobuf(tmp_path: Path) -> None:
    """A fresh worker's first fetch from a prebuilt pack loads only what it uses: the side
    socket's messages are coded by hand (``localwire``), gRPC and the generated stubs load
    with the first gRPC call (bench/fresh_fetch.py times it)."""
    with run_daemon(tmp_path, [], ["--layout", "tp=2"]) as daemon:
        script = textwrap.dedent(
            f"""
            import sys
            import torch
            from weightd.client import WeightClient
            client = WeightClient({daemon.target!r})
            state, info = client.fetch_with_info(1, 2)
            assert info.transport == "shm" and not info.pack.built, info
            assert len(state) == 39, len(state)
            loaded = sorted(
                m for m, v in sys.modules.items()
                if v is not None and m.split(".")[0] in ("grpc", "google", "grpc_health")
                or m.startswith("weightd.v1")
            )
            print("loaded", loaded)
            """
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "loaded []"


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        ("missing", "is not a directory"),
        ("no-config", "config.json: file does not exist"),
        ("bad-index", "model.safetensors.index.json: not valid JSON"),
        ("escape", "is not a normalized relative path"),
    ],
)
def test_serve_refuses_a_bad_checkpoint_with_one_line(
    tmp_path: Path, setup: str, needle: str
) -> None:
    model = tmp_path / "model"
    if setup != "missing":
        model.mkdir()
    if setup in ("bad-index", "escape"):
        (model / "config.json").write_text("{}")
    if setup == "bad-index":
        (model / "model.safetensors.index.json").write_text("{not json")
    if setup == "escape":
        (model / "model.safetensors.index.json").write_text(
            '{"weight_map": {"w": "../../etc/passwd.safetensors"}}'
        )
    done = subprocess.run(
        weightd_command("serve", "--model", str(model), "--listen", f"unix://{tmp_path}/s.sock"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr
    assert needle in errors[0]
    assert "Traceback" not in done.stderr


def test_second_daemon_on_the_same_socket_fails_clearly(tmp_path: Path) -> None:
    with run_daemon(tmp_path, []) as daemon:
        done = subprocess.run(
            weightd_command("serve", "--listen", daemon.target),
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp_path / "cache")),
        )
        assert done.returncode != 0
        assert "already serving" in done.stderr and str(daemon.process.pid) in done.stderr
        # ... and the first daemon is unaffected.
        with WeightClient(daemon.target, timeout=30) as client:
            assert client.list_models()[0].ready


def test_sigterm_exits_zero(tmp_path: Path) -> None:
    with run_daemon(tmp_path, []) as daemon:
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(60) == 0
        assert "exit" in daemon.log()


def test_tcp_requires_tls_unless_insecure(tmp_path: Path) -> None:
    """TCP without TLS is refused, loopback included; --insecure allows it, loudly."""
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp_path / "cache"))
    for address in ("0.0.0.0:0", "127.0.0.1:0"):
        done = subprocess.run(
            weightd_command(
                "serve", "--listen", address, "--admin-listen", f"unix://{tmp_path}/a/admin.sock"
            ),
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert done.returncode != 0
        assert f"refusing to serve weights on TCP {address} without TLS" in done.stderr
        assert "Traceback" not in done.stderr
    with run_daemon(tmp_path, [], ["--insecure"], listen="127.0.0.1:0") as daemon:
        assert "INSECURE: serving weights over plaintext TCP on 127.0.0.1:" in daemon.log()
        with WeightClient(daemon.target, timeout=60) as client:
            assert client.list_models()[0].ready
