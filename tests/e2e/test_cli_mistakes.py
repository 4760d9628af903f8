"""What a user's slip or change of mind gets from the real command (issue 48, points 6,
9 and 11), out of process: a mistyped option is one line naming the closest one; Ctrl-C
is one line and a non-zero status, never a traceback and never a verdict on a good
checkpoint; a second daemon is refused before it logs anything; a clean exit leaves no
lock file; a client aimed at a file that is no socket is told so.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import run_daemon, weightd_command

pytestmark = pytest.mark.e2e

#: Big enough that hashing it takes many progress intervals (5 s each) on any machine
#: this runs on; sparse, so it costs no disk and no writing.
BIG_BYTES = 64 << 30


def _weightd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(weightd_command(*args), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "unknown", "closest"),
    [
        (["serve", "--modle", "/models/llama"], "--modle", "--model"),
        (["fetch", "--ouy", "x"], "--ouy", "--out"),  # before the missing --rank, --out
        (["serve", "--model=/m", "--layuot", "tp=2"], "--layuot", "--layout"),
        (["config", "show", "--jsn"], "--jsn", "--json"),
        (["--verison"], "--verison", "--version"),
    ],
)
def test_a_mistyped_option_is_one_line_naming_the_closest(
    args: list[str], unknown: str, closest: str
) -> None:
    done = _weightd(*args)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert f"error: unknown option {unknown} (did you mean {closest}?)" in line, line
    assert "usage:" not in line and "required" not in line


def test_other_usage_mistakes_are_one_line_and_status_1_too() -> None:
    done = _weightd("fetch", "unix:///nowhere.sock", "--rank", "1")
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("weightd fetch: error: the following arguments are required:"), line
    assert line.endswith("see 'weightd fetch --help'")


def _big_checkpoint(directory: Path) -> Path:
    """A valid one-tensor checkpoint of :data:`BIG_BYTES` zeros (a sparse file)."""
    directory.mkdir()
    config = {"architectures": ["FooForCausalLM"], "model_type": "foo"}
    (directory / "config.json").write_text(json.dumps(config))
    rows = BIG_BYTES // 4096
    header = {"foo.weight": {"dtype": "F32", "shape": [rows, 1024], "data_offsets": [0, BIG_BYTES]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + BIG_BYTES)
    return directory


def _interrupt_while_hashing(args: list[str], tmp: Path) -> tuple[int, str]:
    """Start ``weightd ARGS``, send SIGINT (what Ctrl-C sends) once its hashing has
    reported progress, and return its status and everything it wrote."""
    out_path = tmp / "out.log"
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp / "cache"))
    with open(out_path, "w") as out:
        process = subprocess.Popen(
            weightd_command(*args), stdout=out, stderr=subprocess.STDOUT, text=True, env=env
        )
    try:
        deadline = time.monotonic() + 120
        while "hashing big: " not in out_path.read_text():
            assert process.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.2)
        assert process.poll() is None  # mid-verification: hashing, not done
        process.send_signal(signal.SIGINT)
        status = process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return status, out_path.read_text()


def test_ctrl_c_during_weightd_verify(tmp_path: Path) -> None:
    model = _big_checkpoint(tmp_path / "big")
    status, out = _interrupt_while_hashing(["verify", str(model)], tmp_path)
    assert status == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert out.splitlines()[-1] == "weightd verify: interrupted", out
    assert "FAILED" not in out and "OK" not in out


def test_ctrl_c_during_serves_verification(tmp_path: Path) -> None:
    model = _big_checkpoint(tmp_path / "big")
    run = tmp_path / "run"
    args = ["serve", "--listen", f"unix://{run}/w.sock", "--model", f"big={model}"]
    status, out = _interrupt_while_hashing(args, tmp_path)
    assert status == 130, out
    assert "Traceback" not in out, out
    assert out.splitlines()[-1].endswith('exit status=130 reason="signal 2 during start-up"'), out
    assert "verify_failed" not in out and "failed" not in out, out  # the checkpoint is good
    assert sorted(p.name for p in run.iterdir() if p.name.endswith(".lock")) == []


def test_a_second_daemon_is_refused_before_its_start_line_and_a_clean_exit_leaves_no_lock(
    tmp_path: Path,
) -> None:
    from weightd.server.cli.demo import ensure_demo_checkpoint

    model = Path(ensure_demo_checkpoint(str(tmp_path / "demo-cache")))
    run = tmp_path / "run"
    with run_daemon(tmp_path, [("demo", model)]) as daemon:
        done = _weightd("serve", "--listen", daemon.target, "--model", str(model))
        assert {"weightd.sock.lock", "admin.sock.lock"} <= {p.name for p in run.iterdir()}
        daemon.process.send_signal(signal.SIGTERM)
        assert daemon.process.wait(60) == 0
    assert done.returncode == 1
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()  # no `start` line, no `listening` line before it
    pid = daemon.process.pid
    expected = f"weightd serve: error: another weightd (pid {pid}) is already serving on "
    assert line == expected + daemon.target, line
    assert [p.name for p in run.iterdir() if p.name.endswith(".lock")] == []


def test_a_client_given_a_regular_file_is_told_it_is_no_socket(tmp_path: Path) -> None:
    path = tmp_path / "weightd.sock"
    path.write_text("not a socket\n")
    done = _weightd("list", f"unix://{path}")
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert f"{path} is a regular file, not a socket" in line, line
    assert "nothing listens" not in line


def test_the_vllm_loaders_refusal_finds_where_the_served_version_was_read(
    tmp_path: Path,
) -> None:
    """What an identity refusal names (issue 48, point 4), asked of a real daemon: the
    version it serves and the directory that version was read from."""
    from weightd.client import WeightClient
    from weightd.server.cli.demo import ensure_demo_checkpoint
    from weightd.vllm.loader.model_loader import _source

    model = Path(ensure_demo_checkpoint(str(tmp_path / "demo-cache")))
    with run_daemon(tmp_path, [("demo", model)]) as daemon, WeightClient(daemon.target) as client:
        desc = client.describe("demo")
        assert desc.version >= 1
        assert _source(client, desc) == str(model)
