"""Strings from outside never leave the daemon raw, and configuration shows no secret.

A real daemon out of process and the real clients for error details; the real CLI for
``weightd config show`` (text and JSON) and a hostile TOML file.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningDaemon, run_daemon, weightd_command
from weightd.client import AdminClient, WeightdError

pytestmark = pytest.mark.e2e

HOSTILE = "/nowhere/\x1b[2J\x1b]0;owned\x07\r\nFAKE log line \u202e"
RAW = ("\x1b", "\r", "\n", "\x07", "\u202e")
SECRET = "s3cr3t-Pa55"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    from weightd.server.cli.demo import ensure_demo_checkpoint

    tmp = tmp_path_factory.mktemp("hostile")
    model = Path(ensure_demo_checkpoint(str(tmp / "demo")))
    (tmp / "adapters").mkdir()
    with run_daemon(tmp, [("demo", model)], ["--adapter-root", str(tmp / "adapters")]) as d:
        yield d


def _raw_in(text: str) -> list[str]:
    return [c for c in RAW if c in text]


@pytest.mark.parametrize("field", ["source", "manifest"])
def test_publish_error_details_escape_what_the_client_sent(
    daemon: RunningDaemon, field: str
) -> None:
    with AdminClient(daemon.address("admin"), timeout=60) as admin:
        args = {"source": HOSTILE} if field == "source" else {"source": "/", "manifest": HOSTILE}
        with pytest.raises(WeightdError) as caught:
            admin.publish(model="demo", **args)
    detail = str(caught.value)
    assert "owned" in detail or "nowhere" in detail, detail  # it is quoted, escaped
    assert _raw_in(detail) == [], detail


def test_load_adapter_error_details_escape_the_source(daemon: RunningDaemon) -> None:
    with (
        AdminClient(daemon.address("admin"), timeout=60) as admin,
        pytest.raises(WeightdError) as caught,
    ):
        admin.load_adapter("a", HOSTILE, model="demo")
    assert _raw_in(str(caught.value)) == [], str(caught.value)
    log = daemon.log()
    assert not any(line.startswith("FAKE") for line in log.splitlines())
    assert _raw_in(log.replace("\n", "")) == []


def _config_show(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        weightd_command("config", "show", *args),
        capture_output=True,
        text=True,
        env=dict(os.environ, **(env or {})),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("source", ["toml", "env", "flag"])
def test_config_show_prints_no_credential(tmp_path: Path, source: str) -> None:
    endpoint = f"https://AKIAEXAMPLE:{SECRET}@minio.local:9000/?token={SECRET}2"
    args: list[str] = []
    env: dict[str, str] = {}
    if source == "toml":
        (tmp_path / "w.toml").write_text(f'[s3]\nendpoint = "{endpoint}"\n')
        args = ["--config", str(tmp_path / "w.toml")]
    elif source == "env":
        env = {"WEIGHTD_S3_ENDPOINT": endpoint}
    else:
        args = ["--s3-endpoint", endpoint, "--model", f"s3://u:{SECRET}@bucket/prefix/"]
    text = _config_show(tmp_path, *args, env=env)
    as_json = _config_show(tmp_path, "--json", *args, env=env)
    for shown in (text, as_json):
        assert SECRET not in shown and "AKIAEXAMPLE" not in shown
        assert "minio.local:9000" in shown  # the rest of the endpoint is still said
    value = json.loads(as_json)["settings"]["s3.endpoint"]["value"]
    assert value == "https://***@minio.local:9000/?token=***"


def test_a_deeply_nested_toml_file_is_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    proc = subprocess.run(
        weightd_command("config", "show", "--config", str(path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and len(proc.stderr) < 1000, proc.stderr[:2000]
    assert str(path) in proc.stderr and "nested too deep" in proc.stderr
