"""The vLLM loader's report names the trust root that proved the served version: a
checkpoint signed with the real ``model_signing`` tool, served with ``--signature``,
loaded by a real vLLM engine (TP=1) with ``load_format="weightd"``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_daemon
from tests.trust.oms_signing import ec_keypair, sign_key

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def test_loader_report_names_the_oms_signer(
    vllm_python: Path, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], model)
    private, public = ec_keypair(tmp_path / "keys")
    signature = sign_key(model, private, tmp_path / "model.sig")
    extra = ["--signature", str(signature), "--trust-key", str(public), "--layout", "tp=1"]
    out = tmp_path / "result.json"
    with run_daemon(tmp_path, [("llama", model)], extra) as d:
        proc = subprocess.run(
            [str(vllm_python), str(Path(__file__).with_name("engine_run.py")),
             "--dir", str(model), "--target", d.target, "--model", "llama",
             "--loaders", "weightd", "--no-generate", "--out", str(out)],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-8000:]
    [report] = json.loads(out.read_text())["weightd"]["reports"]
    assert report["trust_root"].startswith("oms-key:sha256:"), report
    assert "proven by oms-key:sha256:" in proc.stdout + proc.stderr
