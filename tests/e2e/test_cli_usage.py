"""The CLI as a careless user meets it (issue #15, items 13 and 17), out of process.

Start-up mistakes are one line with nothing bound; client commands understand a bare
socket path, say "no daemon" plainly, tell the daemon's NOT_FOUND from no daemon, keep
quiet when their reader goes away, and do not import torch unless they make tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon, weightd_command
from tests.trust import craft

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


def test_a_bare_socket_path_is_the_unix_socket(demo_daemon: RunningDaemon) -> None:
    path = demo_daemon.target.removeprefix("unix://")
    done = _weightd("list", path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("llama-demo\t")


@pytest.mark.parametrize("spelled", ["unix://{}", "{}"])
def test_a_missing_socket_says_no_daemon(tmp_path: Path, spelled: str) -> None:
    sock = tmp_path / "nobody.sock"
    for command in ("list", "describe"):
        done = _weightd(command, spelled.format(sock))
        assert done.returncode == 1
        (line,) = _lines(done)
        assert f"no daemon at unix://{sock}" in line and "running?" in line, line
        assert "connect failed" not in line and "DNS" not in line


def test_a_dead_socket_says_nothing_answers(tmp_path: Path) -> None:
    """A socket file nobody listens on (a daemon that died): refused, said plainly."""
    import socket

    sock = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()
    done = _weightd("list", f"unix://{sock}")
    assert done.returncode == 1
    (line,) = _lines(done)
    assert f"no daemon answering at unix://{sock}" in line and "running" in line, line


def test_health_of_an_unknown_service_is_the_daemons_not_found(
    demo_daemon: RunningDaemon,
) -> None:
    done = _weightd("health", demo_daemon.target, "--service", "weightd.v1.Weights/nope")
    assert done.returncode == 1
    assert "NOT_FOUND (the daemon answered" in done.stdout, done.stdout
    assert "UNREACHABLE" not in done.stdout
    ok = _weightd("health", demo_daemon.target, "--service", "weightd.v1.Weights/llama-demo")
    assert ok.returncode == 0 and ok.stdout.rstrip().endswith(": SERVING"), ok.stdout


def test_health_without_a_daemon_is_unreachable(tmp_path: Path) -> None:
    done = _weightd("health", str(tmp_path / "nobody.sock"))
    assert done.returncode == 1
    assert "UNREACHABLE (no daemon at unix://" in done.stdout, done.stdout


@pytest.mark.parametrize("args", [["describe"], ["describe", "--json"], ["list"]])
@pytest.mark.parametrize("buffered", [True, False])
def test_a_closed_pipe_ends_quietly(
    demo_daemon: RunningDaemon, args: list[str], buffered: bool
) -> None:
    """``weightd describe ... | head`` when ``head`` has gone: no message, SIGPIPE's status.

    Buffered (the default for a pipe), the write fails only when the output is flushed.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte is written
    try:
        done = subprocess.run(
            weightd_command(*args, demo_daemon.target),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        os.close(write)
    assert done.stderr == ""
    assert done.returncode == 141


def test_verify_with_a_bad_signature_does_not_say_none_given(tmp_path: Path) -> None:
    model = craft.write_checkpoint(tmp_path / "m")
    key, pub = tmp_path / "k", tmp_path / "k.pub"
    assert (
        _weightd(
            "manifest", "keygen", "--out-private", str(key), "--out-public", str(pub)
        ).returncode
        == 0
    )
    manifest = tmp_path / "manifest.json"
    made = _weightd("manifest", "create", str(model), "--sign-key", str(key), "-o", str(manifest))
    assert made.returncode == 0, made.stderr
    doc = json.loads(manifest.read_text())
    name = sorted(doc["tensors"])[0]
    doc["tensors"][name]["shape"] = [*doc["tensors"][name]["shape"], 1]  # tampered
    manifest.write_text(json.dumps(doc))
    done = _weightd("verify", str(model), "--manifest", str(manifest), "--trust-key", str(pub))
    assert done.returncode == 1
    assert any(line.startswith("problem:") and "signature" in line for line in _lines(done))
    assert "none given" not in done.stdout, done.stdout
    assert "trust      NOT ESTABLISHED" in done.stdout
    plain = _weightd("verify", str(model))  # and with no trust asked for, it says so
    assert plain.returncode == 0 and "trust      none given" in plain.stdout


# --- issue #39 point 6: every start-up check before the first log line and bind -----


@pytest.mark.parametrize("case", ["bad-header", "wrong-layout", "s3-without-boto3"])
def test_serve_checks_models_and_extras_before_logging_or_binding(
    tmp_path: Path, case: str
) -> None:
    """A checkpoint that cannot be served, or an s3:// model without boto3, is one line
    before ``start`` is logged or a socket bound (the digests come after: they take time)."""
    from weightd.server.cli.demo import DEMO_CONFIG, write_llama_checkpoint

    model = tmp_path / "model"
    blocked = ""
    if case == "s3-without-boto3":
        source, named = "s3://bucket/models/llama/", "boto3"
        blocked = "sys.modules['boto3'] = None"  # as if the s3 extra were not installed
    else:
        write_llama_checkpoint(str(model), DEMO_CONFIG, shards=1)
        source = str(model)
        if case == "bad-header":
            (shard,) = model.glob("*.safetensors")
            shard.write_bytes(b"\xff" * 64)
            named = shard.name
        else:
            config = json.loads((model / "config.json").read_text())
            config["hidden_size"] *= 2
            (model / "config.json").write_text(json.dumps(config))
            named = str(model)
    run = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import sys
        {blocked}
        from weightd.server.cli.main import main
        sys.exit(main(["serve", "--model", {source!r}, "--listen", "unix://{run}/w.sock"]))
        """
    )
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the daemon served instead of refusing:\n{out}")
    assert proc.returncode == 1, out
    (line,) = out.splitlines()
    assert line.startswith("weightd serve: error: ") and named in line, line
    assert not run.exists()


def test_fetch_help_describes_every_option() -> None:
    done = _weightd("fetch", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for needle in (
        "--rank RANK this worker's tensor-parallel rank",
        "--world-size WORLD_SIZE tensor-parallel size",
        "--model MODEL the served model's name",
        "--timeout SECONDS bound on each call",
        "--pp N pipeline stages",
        "--ep N expert-parallel size",
        "--target ADDRESS",
    ):
        assert needle in text, needle


def test_fetch_takes_a_pipeline_stage(demo_daemon: RunningDaemon, tmp_path: Path) -> None:
    """``weightd fetch --pp/--pp-rank`` (as ``plan`` has): the last stage's share only."""
    from safetensors import safe_open

    out = tmp_path / "stage1.safetensors"
    done = _weightd(
        "fetch", demo_daemon.target, "--rank", "0", "--world-size", "1", "--pp", "2",
        "--pp-rank", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tp 0/1, pp 1/2" in done.stdout, done.stdout
    with safe_open(str(out), "pt") as f:
        names = set(f.keys())
        assert f.metadata()["weightd_layout"]
    assert "lm_head.weight" in names and "model.norm.weight" in names
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in names)
    assert "model.embed_tokens.weight" not in names


def test_fetch_shows_progress_on_a_terminal(demo_daemon: RunningDaemon, tmp_path: Path) -> None:
    """On a terminal, stderr shows what fetch is doing (it was silent for seconds) and the
    line is cleared at the end; stdout keeps only the result."""
    import pty

    leader, follower = pty.openpty()
    out = tmp_path / "r0.safetensors"
    try:
        done = subprocess.run(
            weightd_command(
                "fetch", demo_daemon.target, "--rank", "0", "--world-size", "2", "--out", str(out)
            ),
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            timeout=120,
        )
        os.close(follower)
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
    assert done.returncode == 0
    text = shown.decode()
    assert "weightd fetch: connecting (tp 0/2 from unix://" in text, text
    assert f"weightd fetch: writing {out}" in text
    assert text.endswith("\r")  # cleared, not left behind
    assert done.stdout.startswith("wrote 39 tensors")
    piped = _weightd(
        "fetch", demo_daemon.target, "--rank", "0", "--world-size", "2", "--out", str(out)
    )
    assert "connecting" not in piped.stderr  # not a terminal: nothing drawn
