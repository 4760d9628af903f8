"""docs/examples/oms_sign_and_serve.sh, run as a reader would run it (the trust guide
includes it as it is): signed by the real ``model_signing`` CLI, verified and served by
weightd; the same daemon command on a changed checkpoint is refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import weightd_command

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "examples" / "oms_sign_and_serve.sh"


def test_sign_with_model_signing_serve_with_weightd(
    transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(transformers_models["llama"], model)
    out = tmp_path / "trust"
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run(
        ["bash", str(SCRIPT), str(model), str(out)],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    assert "OK: every check holds" in text
    assert f"OMS signature {out}/model.sig: EC key sha256:" in text
    assert "mymodel\t" in done.stdout and "trust oms-key:sha256:" in done.stdout, text
    assert oct(os.stat(out / "signing.pem").st_mode & 0o777) == "0o600"
    # The script's checks are real: one changed file, and the same command refuses.
    (model / "generation_config.json").write_text("{}")
    again = subprocess.run(
        weightd_command(
            "verify", str(model), "--signature", str(out / "model.sig"),
            "--trust-key", str(out / "signing.pub"),
        ),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 1
    assert "generation_config.json: sha256 is" in again.stdout, again.stdout
