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


# --- the dpkg lock (issue #37 item 14): waited for with a bound, never exit 100 at once ----

APT_LOCK = REPO / ".ci" / "apt-lock.sh"


def _hold(path: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process holding ``path`` locked as dpkg does (fcntl), for ``seconds``."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o640)\n"
            "fcntl.lockf(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\n",
            str(path),
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def _apt(tmp: Path, script: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """``script`` in bash with .ci/apt-lock.sh sourced, a recording apt-get on PATH."""
    import time

    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "apt-get"
    fake.write_text(
        "#!/bin/sh\n"
        'echo "$*" >> "$APT_CALLS"\n'
        'if [ -n "$APT_FAIL_ONCE" ] && [ ! -e "$APT_FAIL_ONCE" ]; then\n'
        '  touch "$APT_FAIL_ONCE"\n'
        '  echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 1" >&2\n'
        "  exit 100\n"
        "fi\n"
    )
    fake.chmod(0o755)
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", f". {APT_LOCK}\n{script}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(
            os.environ,
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            APT_CALLS=str(tmp / "calls"),
            **env,
        ),
    )
    return done, time.monotonic() - started


def test_a_held_dpkg_lock_is_waited_for_then_apt_runs(tmp_path: Path) -> None:
    lock = tmp_path / "lock-frontend"
    holder = _hold(lock, 2.5)
    try:
        done, took = _apt(
            tmp_path,
            "apt_get install -y prometheus",
            WEIGHTD_APT_LOCKS=str(lock),
            WEIGHTD_APT_LOCK_TIMEOUT="60",
        )
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr
    assert f"== waiting for {lock}, held by pid {holder.pid} (python" in done.stderr
    assert 1.5 < took < 30
    (call,) = (tmp_path / "calls").read_text().splitlines()
    assert call.startswith("-o DPkg::Lock::Timeout=") and call.endswith("install -y prometheus")
    assert 0 < int(call.split("=")[1].split()[0]) <= 60  # what is left of the bound


def test_a_lock_held_past_the_bound_is_one_line_not_a_hang(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    holder = _hold(lock, 60)
    try:
        done, took = _apt(
            tmp_path,
            "apt_get update",
            WEIGHTD_APT_LOCKS=f"{tmp_path / 'absent'} {lock}",
            WEIGHTD_APT_LOCK_TIMEOUT="1",
        )
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 1
    assert took < 15
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {lock} is still held by pid {holder.pid}") and "1s" in last
    assert not (tmp_path / "calls").exists()  # apt-get never ran


def test_an_apt_get_that_loses_the_race_is_tried_again(tmp_path: Path) -> None:
    done, _ = _apt(
        tmp_path,
        "apt_get update -qq",
        WEIGHTD_APT_LOCKS=str(tmp_path / "free"),
        APT_FAIL_ONCE=str(tmp_path / "failed-once"),
    )
    assert done.returncode == 0, done.stderr
    assert len((tmp_path / "calls").read_text().splitlines()) == 2


def test_setup_runs_apt_only_through_the_bounded_wait() -> None:
    text = (REPO / ".ci" / "setup.sh").read_text()
    commands = [
        line.strip()
        for line in text.splitlines()
        if "apt-get " in line and "#" not in line and "command -v apt-get" not in line
    ]
    assert commands == [], commands  # no bare apt-get: each goes through apt_get
    assert ". .ci/apt-lock.sh" in text and "apt_get update" in text and "apt_get install" in text
