"""Soak: the load scenario for as long as you like, with client kills and a restart.

    .venv/bin/python -m bench.soak --duration 300 --clients 32 \\
        --report bench/results/soak-$(date -u +%Y%m%dT%H%M%SZ).md

Starts a daemon on a generated checkpoint (the demo's Llama-style widths, written once
under ``--work-dir``), with its concurrency limit (``--max-concurrent-rpcs``) below the
number of clients so RESOURCE_EXHAUSTED really happens; runs ``--clients`` client
processes fetching every rank of every ``--world-sizes`` over gRPC, each fetch checked
against its digests and byte for byte against the original files (see
:mod:`bench.loadgen`); SIGKILLs one client every ``--kill-every`` seconds (a new one
takes its place); restarts the daemon at ``--restart-at`` of the run (SIGTERM: drain,
then start; ``--restart-signal kill``: SIGKILL, so cut streams resume). Then writes a
short Markdown report: fetches, bytes, errors by code, retries, throughput,
p50/p99/max latency, and the daemon's RSS, descriptors and threads at the start and
the end. Exit status 1 when any fetch failed or delivered wrong bytes.

No figure is asserted: the machine is shared; read them with its load in mind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.loadgen import ClientSpec, LoadReport, LoadRun
from bench.procstats import ProcUsage, proc_usage
from bench.run import Daemon, start_daemon, stop_daemon

ROOT = Path(__file__).resolve().parent.parent


def _checkpoint(work: Path) -> Path:
    from weightd.server.cli.demo import DEMO_CONFIG, write_llama_checkpoint

    model = work / "soak-llama"
    if not (model / "model.safetensors.index.json").exists():
        staging = work / f".soak-llama.{os.getpid()}"
        write_llama_checkpoint(str(staging), dict(DEMO_CONFIG), shards=3, seed=5)
        staging.rename(model)
    return model


def _start(model: Path, work: Path, args: argparse.Namespace, n: int) -> Daemon:
    sock = work / "run" / "weightd.sock"
    sock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    extra = [
        "--max-concurrent-rpcs", str(args.max_concurrent_rpcs),
        "--max-workers", str(args.max_concurrent_rpcs),
        "--grace", "30",
    ]  # fmt: skip
    return start_daemon(model, f"unix://{sock}", work / f"daemon-{n}.log", extra)


def _markdown(
    args: argparse.Namespace,
    report: LoadReport,
    start: ProcUsage,
    end: ProcUsage,
    before_restart: ProcUsage | None,
    restarts: int,
    started_at: str,
) -> str:
    s = report.summary()
    errors = ", ".join(f"{k} {v}" for k, v in sorted(report.errors.items())) or "none"
    retries = ", ".join(f"{k} {v}" for k, v in sorted(report.retries.items())) or "none"
    layouts = ", ".join(f"{k}: {v}" for k, v in sorted(report.by_layout.items()))
    lines = [
        f"# weightd soak, {started_at}",
        "",
        f"`python -m bench.soak {' '.join(sys.argv[1:])}`",
        "",
        f"Host: {platform.node()}, {os.cpu_count()} CPUs (shared with other work: read the "
        f"figures with that in mind), Python {platform.python_version()}.",
        f"Daemon: `--max-concurrent-rpcs {args.max_concurrent_rpcs}` (below the "
        f"{args.clients} clients on purpose), restarted {restarts} time(s) mid-run "
        f"(SIG{args.restart_signal.upper()}); "
        f"{report.clients_killed} client process(es) SIGKILLed and replaced.",
        "",
        "| | |",
        "|---|---|",
        f"| duration | {s['seconds']} s |",
        f"| client processes | {args.clients} (world sizes {args.world_sizes}, gRPC) |",
        f"| fetches | {report.fetches} ({report.ok} complete and bit-exact) |",
        f"| wrong bytes | {len(report.mismatches)} |",
        f"| bytes delivered | {s['gigabytes']} GB |",
        f"| errors (after retries) | {errors} |",
        f"| retries | {retries} |",
        f"| resumed streams / bytes sent twice | {report.resumes} / {report.resent_bytes} |",
        f"| throughput | {s['GB/s']} GB/s, {s['fetches/s']} fetches/s |",
        f"| fetch latency p50 / p99 / max | {s['p50_ms']} / {s['p99_ms']} / {s['max_ms']} ms |",
        f"| daemon at start | {start.row()} |",
        *(
            [f"| first daemon just before its restart | {before_restart.row()} |"]
            if before_restart is not None
            else []
        ),
        f"| daemon at end{' (the one started at the restart)' if restarts else ''} | {end.row()} |",
        "",
        f"Fetches per rank/world size: {layouts}.",
        "",
    ]
    if report.error_details or report.mismatches:
        lines += ["First failures:", ""]
        lines += [f"- {e}" for e in (report.error_details + report.mismatches)[:10]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=300, help="seconds of load")
    p.add_argument("--clients", type=int, default=32, help="client processes")
    p.add_argument("--world-sizes", default="1,2,4", help="every rank of each is fetched")
    p.add_argument("--max-concurrent-rpcs", type=int, default=8)
    p.add_argument("--kill-every", type=float, default=30, help="SIGKILL a client (0: never)")
    p.add_argument(
        "--restart-at", type=float, default=0.5, help="fraction of the run (0: no restart)"
    )
    p.add_argument(
        "--restart-signal",
        choices=("term", "kill"),
        default="term",
        help="term: drain then exit; kill: SIGKILL (cut streams resume from their last tensor)",
    )
    p.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "weightd-soak")
    p.add_argument("--report", type=Path, default=None, help="Markdown report (also printed)")
    args = p.parse_args(argv)
    world_sizes = tuple(int(w) for w in args.world_sizes.split(","))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = _checkpoint(args.work_dir)
    started_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    daemons = 1
    daemon = _start(model, args.work_dir, args, daemons)
    try:
        start_usage = proc_usage(daemon.process.pid)
        specs = [
            ClientSpec(daemon.target, str(model), world_sizes=world_sizes, offset=i)
            for i in range(args.clients)
        ]
        run = LoadRun(specs)
        run.start(args.duration)
        t0 = time.monotonic()
        restart_at = args.restart_at * args.duration if args.restart_at else None
        next_kill = args.kill_every or None
        kills = 0
        before_restart: ProcUsage | None = None
        while time.monotonic() - t0 < args.duration:
            run.pump(0.5)
            now = time.monotonic() - t0
            if next_kill is not None and now >= next_kill:
                run.kill_one(kills)
                kills += 1
                next_kill += args.kill_every
            if restart_at is not None and now >= restart_at:
                restart_at = None
                before_restart = proc_usage(daemon.process.pid)
                if args.restart_signal == "kill":
                    daemon.process.kill()
                    daemon.process.wait(60)
                else:
                    stop_daemon(daemon)  # SIGTERM: drains in-flight fetches, then exits
                daemons += 1
                daemon = _start(model, args.work_dir, args, daemons)
        report = run.finish()
        time.sleep(2)  # let the last streams end
        end_usage = proc_usage(daemon.process.pid)
    finally:
        stop_daemon(daemon)
    text = _markdown(args, report, start_usage, end_usage, before_restart, daemons - 1, started_at)
    print(text)
    print(json.dumps(report.summary()))
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    return 1 if report.errors or report.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
