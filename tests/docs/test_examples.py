"""The runnable examples in docs/examples/, run as a reader would run them.

Each example is included into a guide page as it is (pymdownx.snippets), so what the
reader sees is what these tests run: the quick start on a checkpoint, signing and
verifying one, and a tensor-parallel Llama built from a stock Hugging Face model and
the per-rank shares weightd serves, whose logits must equal the unsharded model's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import run_daemon

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "docs" / "examples"


def _env() -> dict[str, str]:
    """The reader's shell: this interpreter's `weightd` and `python` first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def test_quickstart_script(demo_checkpoint: Path, tmp_path: Path) -> None:
    env = _env() | {"TMPDIR": str(tmp_path)}
    result = subprocess.run(
        ["bash", str(EXAMPLES / "quickstart.sh"), str(demo_checkpoint)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "OK" in out  # weightd verify
    assert "layout: tp=2" in out  # weightd plan
    assert "mymodel" in out  # weightd list
    assert "rank 0 of 2: " in out and " tensors, " in out  # fetch_rank.py
    assert not list(tmp_path.glob("tmp.*")), "the script leaves its socket directory behind"


def test_sign_and_verify_script(demo_checkpoint: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "trust"
    result = subprocess.run(
        ["bash", str(EXAMPLES / "sign_and_verify.sh"), str(demo_checkpoint), str(out_dir)],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert {p.name for p in out_dir.iterdir()} == {"release.key", "release.pub", "manifest.json"}
    assert oct(os.stat(out_dir / "release.key").st_mode & 0o777) == "0o600"
    # The same check against a tampered manifest fails: the script's last step is real.
    manifest = json.loads((out_dir / "manifest.json").read_text())
    manifest["files"]["config.json"]["size"] += 1
    (out_dir / "manifest.json").write_text(json.dumps(manifest))
    again = subprocess.run(
        [sys.executable, "-m", "weightd.server.cli.main", "verify", str(demo_checkpoint),
         "--manifest", str(out_dir / "manifest.json"), "--trust-key", str(out_dir / "release.pub")],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert again.returncode != 0


def test_tensor_parallel_llama_from_a_stock_model_equals_the_unsharded_one(
    demo_checkpoint: Path, tmp_path: Path
) -> None:
    from transformers import LlamaForCausalLM

    prompt = [1, 306, 2658, 278, 3186]
    logits_path = tmp_path / "logits.pt"
    # The layout declared, as the guide says: its packs exist before SERVING, so both
    # ranks map them (an undeclared one is served over gRPC while its packs build).
    declared = ["--layout", "llama=tp=2"]
    with run_daemon(tmp_path, [("llama", demo_checkpoint)], declared) as daemon:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", str(EXAMPLES / "tp_model.py"), daemon.target,
             str(demo_checkpoint), "--prompt", ",".join(map(str, prompt)),
             "--save-logits", str(logits_path)],
            capture_output=True, text=True, env=_env(), timeout=420,
        )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "rank 0: share loaded over shm" in out and "rank 1: share loaded over shm" in out

    model = LlamaForCausalLM.from_pretrained(demo_checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = torch.load(logits_path)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    continuation = tokens[0, len(prompt) :].tolist()
    for rank in (0, 1):  # every rank generated the unsharded model's tokens
        assert f"rank {rank}: {continuation}" in out, out
