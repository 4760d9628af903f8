"""The load scenario: many client processes fetching every rank, over and over.

Used by ``tests/reliability/test_load.py`` (a bounded run with assertions) and by
``bench/soak.py`` (a long run with a report). Each client is a process (the client is
Python: threads would share one interpreter lock), started from a fork server that
has already imported torch and the client, so 32 of them start in seconds instead of
each importing torch on two cores.

Every fetch is checked twice: by the client itself (each slice's SHA-256 against the
daemon's digest) and here, byte for byte, against a slice cut from the original
safetensors files with ``safe_open`` and the independent rules of
:func:`bench.ckpt.split_of` (not weightd's planner). A client retries only what its
:class:`~weightd.client.RetryPolicy` allows (RESOURCE_EXHAUSTED, UNAVAILABLE); any
other failure is recorded by code, never hidden.

Each client sends one record per fetch down its own pipe (not a shared queue: a
client killed mid-send must not corrupt anyone else's channel).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Imported once in the fork server, shared by every client process it forks.
PRELOAD = ["torch", "grpc", "weightd.client", "safetensors", "bench.ckpt"]


@dataclass(frozen=True)
class ClientSpec:
    """What one client process does."""

    target: str
    model_dir: str  # the original checkpoint, for the independent reference slices
    world_sizes: tuple[int, ...] = (1, 2, 4)
    transport: str = "grpc"
    timeout: float = 120.0
    #: Retry policy: backoff bounds and time budget (see weightd.client.RetryPolicy).
    initial_backoff: float = 0.02
    max_backoff: float = 1.0
    retry_seconds: float = 120.0
    offset: int = 0  # where in the (world size, rank) cycle this client starts


def reference_slices(model_dir: str, ws: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s slices at world size ``ws``, cut from the files independently."""
    from safetensors import safe_open

    from bench.ckpt import split_of

    root = Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    out = {}
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t = f.get_tensor(name)
                cut = split_of(name, config, ws, rank)
                if cut is not None:
                    dim, start, stop = cut
                    t = t.narrow(dim, start, stop - start)
                out[name] = t.contiguous()
    return out


def mismatch(got: dict[str, Any], want: dict[str, Any]) -> str:
    """'' when ``got`` is bit-identical to ``want``; else what differs."""
    import torch

    if set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        return f"names differ: missing {missing[:3]}, extra {extra[:3]}"
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{name}: {g.dtype} {tuple(g.shape)} != {w.dtype} {tuple(w.shape)}"
        if not torch.equal(g.contiguous().view(torch.uint8), w.view(torch.uint8)):
            return f"{name}: bytes differ from the original's slice"
    return ""


def client_main(spec: ClientSpec, conn: multiprocessing.connection.Connection) -> None:
    """One client process: prepare references, say ready, fetch until told the end."""
    import torch

    from weightd.client import RetryPolicy, WeightClient, WeightdError

    torch.set_num_threads(1)
    cycle = [(ws, r) for ws in spec.world_sizes for r in range(ws)]
    want = {key: reference_slices(spec.model_dir, *key) for key in cycle}
    policy = RetryPolicy(
        initial_backoff=spec.initial_backoff,
        max_backoff=spec.max_backoff,
        total_seconds=spec.retry_seconds,
    )
    client = WeightClient(spec.target, timeout=spec.timeout, retry=policy)
    conn.send({"ready": os.getpid()})
    end = conn.recv()  # the time.time() at which to stop
    i = spec.offset
    while time.time() < end:
        ws, rank = cycle[i % len(cycle)]
        i += 1
        before = Counter(client.retry_stats.retries)
        started = time.perf_counter()
        record: dict[str, Any] = {"ws": ws, "rank": rank, "code": "", "mismatch": ""}
        try:
            state = client.fetch(rank, ws, transport=spec.transport)  # type: ignore[arg-type]
            record["mismatch"] = mismatch(state, want[(ws, rank)])
            record["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
        except WeightdError as exc:
            record["code"] = exc.code.name
            record["detail"] = exc.detail[:300]
            record["bytes"] = 0
        record["seconds"] = time.perf_counter() - started
        record["retries"] = dict(Counter(client.retry_stats.retries) - before)
        report = client.last_resume
        record["resent"] = report.resent_bytes if report else 0
        record["resumes"] = len(report.resumed_at) if report else 0
        conn.send(record)
    client.close()
    conn.send({"done": os.getpid()})


@dataclass
class LoadReport:
    """Everything the clients recorded, summed."""

    clients: int = 0
    seconds: float = 0.0
    fetches: int = 0
    ok: int = 0
    bytes: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    error_details: list[str] = field(default_factory=list)
    retries: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    resumes: int = 0
    resent_bytes: int = 0
    clients_killed: int = 0
    #: Clients that ended without saying done (a crash): exit codes, never ignored.
    clients_lost: list[int] = field(default_factory=list)
    by_layout: Counter[str] = field(default_factory=Counter)

    def add(self, record: dict[str, Any]) -> None:
        self.fetches += 1
        self.by_layout[f"{record['rank']}/{record['ws']}"] += 1
        self.retries.update(record["retries"])
        self.resent_bytes += record["resent"]
        self.resumes += record["resumes"]
        if record["code"]:
            self.errors[record["code"]] += 1
            if len(self.error_details) < 10:
                self.error_details.append(f"{record['code']}: {record.get('detail', '')}")
            return
        if record["mismatch"]:
            self.mismatches.append(f"rank {record['rank']}/{record['ws']}: {record['mismatch']}")
            return
        self.ok += 1
        self.bytes += record["bytes"]
        self.latencies.append(record["seconds"])

    def percentile(self, p: float) -> float:
        if not self.latencies:
            return float("nan")
        if len(self.latencies) == 1:
            return self.latencies[0]
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[int(p) - 1]

    def summary(self) -> dict[str, Any]:
        secs = self.seconds or float("nan")
        return {
            "clients": self.clients,
            "seconds": round(self.seconds, 2),
            "fetches": self.fetches,
            "ok": self.ok,
            "gigabytes": round(self.bytes / 1e9, 3),
            "GB/s": round(self.bytes / 1e9 / secs, 3),
            "fetches/s": round(self.ok / secs, 2),
            "p50_ms": round(self.percentile(50) * 1e3, 1),
            "p99_ms": round(self.percentile(99) * 1e3, 1),
            "max_ms": round(max(self.latencies, default=float("nan")) * 1e3, 1),
            "errors": dict(self.errors),
            "retries": dict(self.retries),
            "mismatches": len(self.mismatches),
            "resumes": self.resumes,
            "resent_bytes": self.resent_bytes,
            "clients_killed": self.clients_killed,
            "clients_lost": self.clients_lost,
        }


class LoadRun:
    """A fleet of client processes against one daemon; the caller drives time and faults."""

    def __init__(self, specs: list[ClientSpec]) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self.report = LoadReport(clients=len(specs))
        self._live: dict[multiprocessing.connection.Connection, Any] = {}
        self._end = 0.0
        self._specs = specs

    def _spawn(self, spec: ClientSpec) -> multiprocessing.connection.Connection:
        mine, theirs = self._ctx.Pipe()
        proc = self._ctx.Process(target=client_main, args=(spec, theirs), daemon=True)
        proc.start()
        theirs.close()
        self._live[mine] = proc
        return mine

    def start(self, duration: float, ready_timeout: float = 300) -> None:
        """Start every client, wait until all are ready, then let them run ``duration`` s."""
        conns = [self._spawn(s) for s in self._specs]
        for conn in conns:
            if not conn.poll(ready_timeout):
                raise RuntimeError(f"a client was not ready within {ready_timeout}s")
            conn.recv()
        self._end = time.time() + duration
        self._started = time.monotonic()
        for conn in conns:
            conn.send(self._end)

    def kill_one(self, index: int) -> None:
        """SIGKILL one running client (whatever it is doing) and start a replacement."""
        if not self._live:
            return
        conn = list(self._live)[index % len(self._live)]
        proc = self._live.pop(conn)
        proc.kill()
        proc.join(30)
        conn.close()
        self.report.clients_killed += 1
        spec = self._specs[index % len(self._specs)]
        fresh = self._spawn(spec)
        if fresh.poll(300):
            fresh.recv()
            fresh.send(self._end)

    def pump(self, seconds: float) -> None:
        """Collect records for up to ``seconds``."""
        until = time.monotonic() + seconds
        while self._live and time.monotonic() < until:
            ready = multiprocessing.connection.wait(
                list(self._live), timeout=max(0.0, until - time.monotonic())
            )
            for conn in ready:
                assert isinstance(conn, multiprocessing.connection.Connection)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    code = self._retire(conn)
                    self.report.clients_lost.append(-1 if code is None else code)
                    continue
                if "done" in msg:
                    self._retire(conn)
                elif "ready" not in msg:
                    self.report.add(msg)

    def _retire(self, conn: multiprocessing.connection.Connection) -> int | None:
        proc = self._live.pop(conn)
        proc.join(30)
        conn.close()
        code: int | None = proc.exitcode
        return code

    def finish(self, timeout: float = 300) -> LoadReport:
        """Wait for every client to end its last fetch; the totals."""
        self.pump(max(0.0, self._end - time.time()) + timeout)
        for conn in list(self._live):
            self._live.pop(conn).kill()
        self.report.seconds = time.monotonic() - self._started
        return self.report


def run_load(specs: list[ClientSpec], duration: float) -> LoadReport:
    """The whole scenario without faults: start, run ``duration`` seconds, collect."""
    run = LoadRun(specs)
    run.start(duration)
    return run.finish()
