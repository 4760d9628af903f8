"""Hot swap end to end: watching TP=2 workers' outputs follow load -> replace -> replace -> unload.

The workers (``tp_forward.follow``, two spawned processes over gloo) learn of each change
only from their WatchAdapters stream; the test waits for both ranks' forward before
the next change, so each forward must use exactly the version the event announced,
and is compared with ``PeftModel`` built by ``peft`` from that version's directory.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.adapters.conftest import Fixture, make_adapter
from tests.conftest import run_daemon
from weightd.client.api.admin import AdminClient

pytestmark = pytest.mark.e2e

IDS = [3, 17, 64, 5, 99, 127, 0, 42]


def peft_logits(base_dir: Path, adapter_dir: Path | None) -> torch.Tensor:
    """The reference: ``transformers`` base, with ``peft``'s adapter from ``adapter_dir``."""
    import peft
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
    with torch.no_grad():
        return model.eval()(torch.tensor([IDS])).logits


def read(path: Path) -> tuple[torch.Tensor, dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("logits"), dict(f.metadata())


def test_watching_workers_outputs_follow_each_version(lora: Fixture, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tests.adapters.tp_forward import rank_main

    third = lora.root / "third"
    if not third.exists():
        make_adapter(lora.base_dir, third, seed=3, r=4)
    steps: list[tuple[str, Path | None]] = [
        ("load", lora.adapter_dir),
        ("replace", lora.second_dir),
        ("replace", third),
        ("unload", None),
    ]
    want = [peft_logits(lora.base_dir, src) for _, src in steps]
    for i in range(len(want)):  # every version (and the base) really gives other outputs
        for j in range(i):
            assert (want[i] - want[j]).abs().max() > 1e-3, (i, j)

    out = tmp_path / "out"
    out.mkdir()
    extra = ["--adapter-root", str(lora.root)]
    with run_daemon(tmp_path, [("tiny-llama", lora.base_dir)], extra) as d:
        args = (2, d.target, str(lora.base_dir), "live", IDS, str(tmp_path / "init"), str(out), 4)
        ctx = mp.start_processes(rank_main, args=args, nprocs=2, join=False, start_method="spawn")

        def wait_for(*names: str) -> None:
            deadline = time.monotonic() + 120
            while not all((out / n).exists() for n in names):
                assert not ctx.join(0.05), "the workers ended early"
                assert time.monotonic() < deadline, f"no {names} from the workers"

        with AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60) as admin:
            wait_for("watching-0", "watching-1")
            versions = []
            for i, (_, src) in enumerate(steps):
                if src is None:
                    versions.append(admin.unload_adapter("live").version)
                else:
                    versions.append(admin.load_adapter("live", str(src)).version)
                wait_for(f"{i}-r0.safetensors", f"{i}-r1.safetensors")
            assert admin.list_adapters() == []
        while not ctx.join(1):
            pass

    assert versions[2] > versions[1] > versions[0] and versions[3] == versions[2]
    for i, ((kind, src), version) in enumerate(zip(steps, versions, strict=True)):
        for rank in range(2):
            logits, meta = read(out / f"{i}-r{rank}.safetensors")
            assert meta["kind"] == kind and meta["event_version"] == str(version), (i, meta)
            if src is not None:
                assert meta["fetched_version"] == str(version), (i, rank, meta)
                assert meta["transport"] == "shm", meta
            torch.testing.assert_close(logits, want[i], atol=1e-5, rtol=0)
