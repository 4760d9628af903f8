"""The CLI as a careless user meets it (issue #15), out of process.

Start-up mistakes are one line with nothing bound; the demo checkpoint has one name
however it is given; commands that make no tensors do not import torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon, weightd_command

pytestmark = pytest.mark.e2e


def _weightd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        weightd_command(*args), capture_output=True, text=True, timeout=120, env=env
    )


def _lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return (done.stdout + done.stderr).splitlines()


# --- item 13: start-up failures are one line, before anything is bound -----------------


def _serve_case(case: str, tmp: Path) -> tuple[list[str], str]:
    """Arguments for ``weightd serve`` that must fail, and the path the line must name."""
    missing = str(tmp / "missing")
    a_file = tmp / "a-file"
    a_file.write_text("not a directory\n")
    bad_json = tmp / "bad.json"
    bad_json.write_text("{not json")
    cases: dict[str, tuple[list[str], str]] = {
        "model-missing": (["--model", missing], missing),
        "model-not-a-directory": (["--model", str(a_file)], str(a_file)),
        "rules-missing": (["--rules", missing], missing),
        "rules-bad": (["--rules", str(bad_json)], str(bad_json)),
        "manifest-missing": (["--manifest", missing], missing),
        "trust-key-missing": (["--manifest", str(bad_json), "--trust-key", missing], missing),
        "tls-cert-missing": (
            ["--tls-cert", missing, "--tls-key", missing, "--admin-listen", "none"],
            missing,
        ),
        "adapter-root-missing": (["--adapter-root", missing], missing),
        "grace-negative": (["--grace", "-1"], "--grace"),
    }
    return cases[case]


@pytest.mark.parametrize(
    "case",
    [
        "model-missing",
        "model-not-a-directory",
        "rules-missing",
        "rules-bad",
        "manifest-missing",
        "trust-key-missing",
        "tls-cert-missing",
        "adapter-root-missing",
        "grace-negative",
    ],
)
def test_serve_refuses_bad_arguments_in_one_line_before_binding(tmp_path: Path, case: str) -> None:
    args, named = _serve_case(case, tmp_path)
    run = tmp_path / "run"
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp_path / "cache"))
    done = _weightd("serve", "--listen", f"unix://{run}/w.sock", *args, env=env)
    assert done.returncode == 1, done.stderr
    (line,) = _lines(done)  # exactly one line: no INFO lines before it, no traceback
    assert line.startswith("weightd serve: error: ") and named in line, line
    assert not run.exists()  # no socket, no lock file, not even the socket's directory


# --- item 17: the client commands ---------------------------------------------------


@pytest.fixture(scope="module")
def demo_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """A daemon serving the demo checkpoint by directory, with no NAME= (default name)."""
    from weightd.server.cli.demo import ensure_demo_checkpoint

    tmp = tmp_path_factory.mktemp("cli")
    demo = ensure_demo_checkpoint(str(tmp / "cache"))
    with run_daemon(tmp, [], ["--model", demo]) as daemon:
        yield daemon


def test_model_named_by_its_directory_has_the_demo_name(demo_daemon: RunningDaemon) -> None:
    """``serve --model DIR`` on the demo checkpoint serves it as ``serve`` alone does."""
    done = _weightd("list", demo_daemon.target)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\t")[0] == "llama-demo"


@pytest.mark.parametrize("command", ["list", "describe", "health"])
def test_metadata_commands_do_not_import_torch(demo_daemon: RunningDaemon, command: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        from weightd.server.cli.main import main
        status = main([{command!r}, {demo_daemon.target!r}])
        print("torch" in sys.modules, "numpy" in sys.modules, file=sys.stderr)
        sys.exit(status)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "llama-demo" in done.stdout or "SERVING" in done.stdout
    assert done.stderr.splitlines()[-1] == "False False", done.stderr


def test_fetch_still_makes_tensors(demo_daemon: RunningDaemon, tmp_path: Path) -> None:
    from safetensors import safe_open

    out = tmp_path / "r1.safetensors"
    done = _weightd(
        "fetch", demo_daemon.target, "--rank", "1", "--world-size", "2", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    with safe_open(str(out), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").shape == (128, 256)
