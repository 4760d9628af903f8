"""Driving ``tests/shm/worker.py`` processes from a test."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any


class Worker:
    """A worker process; :meth:`call` sends one command and returns its answer."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.shm.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.pid} died (exit {self.process.wait(10)})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ok(self, op: str, **args: Any) -> dict[str, Any]:
        reply = self.call(op, **args)
        assert reply["ok"], reply
        return reply

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.call("quit")
                self.process.wait(30)
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
