"""Helpers of tests/vllm/test_vllm_transfer*.py: engines driven by command, hostile proxies.

* :class:`EngineProcess` starts ``transfer_engine.py`` under ``.venv-vllm`` and sends it
  one command at a time (its replies come on a pipe of their own; vLLM's logs go to a
  file). Several engines can run at once; each step waits for its reply.
* :class:`ByteProxy` is a TCP proxy on loopback in front of the daemon's Unix socket
  that a test turns hostile: ``stall_after(n)`` stops forwarding the daemon's bytes to
  the client once ``n`` of them went through (the fetch stalls mid-stream) until
  ``release()``; ``cut()`` closes every connection now and each later one as soon as
  it opens (the fetch is cut off).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class EngineProcess:
    def __init__(
        self,
        python: Path,
        directory: Path,
        tp: int,
        log: Path,
        *,
        target: str | None = None,
        model: str | None = None,
        load_format: str = "auto",
    ) -> None:
        read, write = os.pipe()
        env = dict(os.environ)
        if tp == 2:  # one core per worker (vLLM's CPU workers bind threads per NUMA node)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        cmd = [
            str(python),
            str(HERE / "transfer_engine.py"),
            *("--dir", str(directory), "--tp", str(tp), "--reply-fd", str(write)),
            *("--load-format", load_format),
            *(["--target", target] if target else []),
            *(["--model", model] if model else []),
        ]
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                pass_fds=(write,),
                cwd=ROOT,
            )
        os.close(write)
        self._replies = os.fdopen(read, "r")
        self._pending = False

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply within {timeout}s; log tail:\n{self.tail()}")
            ready, _, _ = select.select([self._replies], [], [], min(left, 5))
            if ready:
                line = self._replies.readline()
                if not line:
                    raise RuntimeError(f"the engine exited; log tail:\n{self.tail()}")
                reply: dict[str, Any] = json.loads(line)
                return reply
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the engine exited with {self.process.returncode}; log tail:\n{self.tail()}"
                )

    def wait_ready(self, timeout: float = 600) -> None:
        reply = self._read(timeout)
        assert reply.get("ready"), reply

    def send(self, op: str, **args: Any) -> None:
        """Send a command without waiting (see :meth:`reply`)."""
        assert not self._pending, "one command at a time"
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        self._pending = True

    def reply(self, timeout: float = 600) -> dict[str, Any]:
        assert self._pending
        self._pending = False
        return self._read(timeout)

    def call(self, op: str, timeout: float = 600, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply(timeout)

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log.read_text()[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                if not self._pending:
                    self.call("quit", timeout=60)
                self.process.wait(60)
            except Exception:
                self.process.kill()
                self.process.wait()
        self._replies.close()


class ByteProxy:
    """A loopback TCP proxy to a Unix socket, that a test can stall or cut (see above)."""

    def __init__(self, unix_path: str) -> None:
        self.unix_path = unix_path
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.target = f"127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._cut = False
        self._stall_at: int | None = None
        self._conns: list[socket.socket] = []
        #: Bytes the daemon sent through this proxy (forwarded or not yet).
        self.from_daemon = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def stall_after(self, n: int) -> None:
        """Forward the daemon's first ``n`` bytes (from now), then hold the rest back."""
        with self._lock:
            self._stall_at = self.from_daemon + n

    def release(self) -> None:
        with self._lock:
            self._stall_at = None
        self._flowing.set()

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            conns, self._conns = self._conns, []
        for c in conns:
            _close(c)
        self._flowing.set()

    def wait_stalled(self, timeout: float = 300) -> None:
        """Until the proxy holds the daemon's bytes back (see :meth:`stall_after`)."""
        deadline = time.monotonic() + timeout
        while not self.stalled:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not stalled after {self.from_daemon} bytes in {timeout}s")
            time.sleep(0.05)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    _close(client)
                    continue
                daemon = socket.socket(socket.AF_UNIX)
                daemon.connect(self.unix_path)
                self._conns += [client, daemon]
            threading.Thread(target=self._pipe, args=(client, daemon, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(daemon, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_daemon: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if from_daemon:
                    with self._lock:
                        if self._stall_at is not None and self.from_daemon >= self._stall_at:
                            self._flowing.clear()
                        self.from_daemon += len(data)
                    self._flowing.wait()
                if self._cut:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def close(self) -> None:
        self._closed = True
        _close(self.server)
        self.cut()


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    s.close()
