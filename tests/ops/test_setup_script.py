""".ci/setup.sh says what it is doing (issue #15, item 16), run for real in a scratch copy.

A fresh set-up took minutes in silence (pip -q). Each step now prints one ``== setup:``
line and pip's own lines are passed through. The scratch copy has the real script and
pyproject.toml; its ``.venv`` is either already set up (the stamp matches) or has no pip,
so the install steps run, show pip's own failure, and stop: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _scratch(tmp: Path) -> Path:
    (tmp / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "setup.sh", tmp / ".ci" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def _run(root: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(root / ".ci" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, **env),
    )


def test_an_up_to_date_venv_says_so(tmp_path: Path) -> None:
    root = _scratch(tmp_path)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
    stamp = hashlib.sha256(
        (root / "pyproject.toml").read_bytes() + (root / ".ci" / "setup.sh").read_bytes()
    ).hexdigest()[:16]
    (root / ".venv" / ".weightd-setup").write_text(stamp + "\n")
    done = _run(root, WEIGHTD_VLLM="0")
    assert done.returncode == 0, done.stderr
    assert "== setup: .venv is up to date" in done.stderr, done.stderr


def test_each_step_prints_a_line_and_pip_speaks_for_itself(tmp_path: Path) -> None:
    root = _scratch(tmp_path)
    # A venv without pip: every pip step fails at once, in pip's own words, offline.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root / ".venv")],
        check=True,
        timeout=120,
    )
    done = _run(root, WEIGHTD_TORCH_SPEC="torch==2.13.0", WEIGHTD_VLLM="0")
    assert done.returncode == 1
    steps = [line for line in done.stderr.splitlines() if line.startswith("== setup: ")]
    assert [s.split(" (")[0] for s in steps] == [
        "== setup: setting up .venv",
        "== setup: pip install torch==2.13.0",
        "== setup: pip install -e .[dev]",
        "== setup: checking that torch, grpc and weightd import",
    ], done.stderr
    assert done.stderr.count("No module named pip") == 2  # pip's output is not hidden
    assert done.stderr.rstrip().endswith("setup failed: see pip output above")
    assert not (root / ".venv" / ".weightd-setup").exists()
