"""Adapters through a real daemon process: admin load/replace/unload/pin, watch, fetch per rank."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.adapters.conftest import Fixture, expected, race
from tests.conftest import run_daemon
from weightd.client import WeightClient
from weightd.client.api.adapters import AdapterEvent
from weightd.client.api.admin import AdminClient
from weightd.client.base.errors import (
    DataLossError,
    FailedPreconditionError,
    NotFoundError,
    PermissionDeniedError,
)


def test_load_watch_fetch_replace_unload(lora: Fixture, tmp_path: Path) -> None:
    config = json.loads((lora.base_dir / "config.json").read_text())
    extra = ["--adapter-root", str(lora.root)]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as d:
        admin = AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60)
        client = WeightClient(d.target, timeout=60)
        events: list[AdapterEvent] = []
        watch = client.watch_adapters()
        seen_three = threading.Event()

        def follow() -> None:
            for e in watch:
                events.append(e)
                if len(events) == 3:
                    seen_three.set()

        follower = threading.Thread(target=follow)
        follower.start()

        v1 = admin.load_adapter("a", str(lora.adapter_dir))
        assert (v1.name, v1.base_model, v1.pinned, v1.leases) == ("a", "tiny-llama", False, 0)
        for rank in range(2):
            got = client.fetch_adapter("a", rank, 2)
            assert (got.version, got.digest) == (v1.version, v1.digest)
            want = expected(lora.adapter_dir, 2, rank, config)
            assert got.tensors.keys() == want.keys()
            for k in want:
                assert torch.equal(got.tensors[k], want[k]), k
            assert got.scaling["model.layers.0.mlp.down_proj"] == 4.0

        # A bad load (outside the roots) changes nothing.
        with pytest.raises(PermissionDeniedError, match="outside the adapter roots"):
            admin.load_adapter("a", str(lora.base_dir))
        with pytest.raises(DataLossError, match="adapter digest: expected sha256:00"):
            admin.load_adapter("a", str(lora.second_dir), expected_digest="sha256:" + "0" * 64)
        assert [(s.name, s.version) for s in admin.list_adapters()] == [("a", v1.version)]

        v2 = admin.load_adapter("a", str(lora.second_dir))
        assert v2.version > v1.version and v2.digest != v1.digest
        got = client.fetch_adapter("a", 1, 2)
        assert got.version == v2.version
        want = expected(lora.second_dir, 2, 1, config)
        assert all(torch.equal(got.tensors[k], want[k]) for k in want)

        assert admin.pin_adapter("a").pinned
        assert not admin.pin_adapter("a", False).pinned
        admin.unload_adapter("a")
        with pytest.raises(NotFoundError, match="no adapter named 'a' is loaded"):
            client.fetch_adapter("a", 0, 2)
        assert seen_three.wait(60)
        watch.close()
        follower.join(60)
        assert [(e.kind, e.name, e.version) for e in events[:3]] == [
            ("load", "a", v1.version),
            ("replace", "a", v2.version),
            ("unload", "a", v2.version),
        ]

        # Admin RPCs are refused on the worker listener.
        worker_admin = AdminClient(d.target, timeout=60)
        with pytest.raises(PermissionDeniedError):
            worker_admin.list_adapters()
        for c in (admin, client, worker_admin):
            c.close()


def test_daemon_without_roots_refuses_loads(lora: Fixture, tmp_path: Path) -> None:
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)]) as d:
        with AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60) as admin:
            with pytest.raises(FailedPreconditionError, match="no adapter roots are configured"):
                admin.load_adapter("a", str(lora.adapter_dir))
            assert admin.list_adapters() == []
        assert d.process.poll() is None


def test_tp2_gloo_forward_matches_peft(lora: Fixture, tmp_path: Path) -> None:
    """The acceptance: a TP=2 gloo forward from weightd's slices equals PeftModel (fp32)."""
    import torch.multiprocessing as mp

    from tests.adapters.tp_forward import rank_main

    ids = [3, 17, 64, 5, 99, 127, 0, 42]
    with torch.no_grad():
        want = lora.peft_model(torch.tensor([ids])).logits
    # A shared-memory budget too small for any pack: "auto" must fall back to gRPC.
    extra = ["--adapter-root", str(lora.root), "--shm-budget-bytes", "4096"]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as d:
        with AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60) as admin:
            admin.load_adapter("a", str(lora.adapter_dir))
        with WeightClient(d.target, timeout=60) as client:
            got = client.fetch_adapter("a", 0, 2)
            assert got.transport == "grpc" and got.info is not None
            [failure] = got.info.fallbacks
            assert failure.transport == "shm" and "budget exhausted" in str(failure.error)
        out = tmp_path / "logits.safetensors"
        args = (2, d.target, str(lora.base_dir), "a", ids, str(tmp_path / "init"), str(out))
        mp.start_processes(rank_main, args=args, nprocs=2, join=True, start_method="spawn")
    got = load_file(str(out))["logits"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    base_out = lora.peft_model.get_base_model()
    with torch.no_grad(), lora.peft_model.disable_adapter():
        plain = base_out(torch.tensor([ids])).logits
    assert (plain - want).abs().max() > 1e-3  # the adapter really changes the output


def test_fetches_race_replace_and_unload_over_grpc(lora: Fixture, tmp_path: Path) -> None:
    """>= 100 gRPC fetches while an operator replaces and unloads in a loop: each fetch is
    complete and digest-checked (by the client) and equals the version it names; no lease
    is left behind."""
    config = json.loads((lora.base_dir / "config.json").read_text())
    want = {d: expected(d, 2, 1, config) for d in (lora.adapter_dir, lora.second_dir)}
    extra = ["--adapter-root", str(lora.root)]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as d:
        admin = AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60)
        race(d.target, admin, "hot", want, "grpc")
        # Every fetch releases its lease when the daemon's stream handler finishes, which
        # may be just after the client read the last message: wait for it, boundedly.
        deadline = time.monotonic() + 30
        while admin.list_adapters()[0].leases and time.monotonic() < deadline:
            time.sleep(0.05)
        [status] = admin.list_adapters()
        assert status.leases == 0
        admin.close()
