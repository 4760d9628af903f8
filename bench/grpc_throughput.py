"""gRPC Fetch throughput of one rank, side by side with bare Python gRPC (the ceiling).

Not a test: prints a table. Every row streams the same amount of data over a Unix
socket, from a server process to a fresh client process (so the client's tensors are
fresh memory, as in a real worker), one stream at a time. Rows:

  bare-raw        a generic gRPC handler yielding the rank's bytes in 1 MiB ``bytes``
                  messages (identity serializers); the client counts them. No protobuf,
                  no hashing, no tensors: the transport's own ceiling.
  bare-pb         the same bytes as ``FetchResponse`` messages with one 1 MiB chunk each,
                  built by the server and parsed by the client with the generated code;
                  no hashing, no tensors, no file reads ("Python gRPC, 1 MiB protobuf
                  chunks" in PERFORMANCE.md).
  before          ``weightd serve`` and ``WeightClient.fetch(transport="grpc")`` from the
                  baseline source (``git archive`` of --baseline-rev: both sides old).
  after-sha256    this working tree, both sides, the client keeping SHA-256 slice
                  digests (``slice_digest="sha256"``: what a client without blake3 gets).
  after           this working tree, both sides, defaults: BLAKE3 slice digests, the
                  daemon re-hashing only streams that ask (a client asks after a
                  digest mismatch).
  after-rehash    ``after`` against a daemon started with ``--fetch-rehash``: every
                  stream re-hashed as it is sent (the default before 2026-12-04;
                  older commands in docs/ name this daemon's opposite
                  ``after-norehash``, which is now ``after``).
  after-into      ``after``, received into tensors the caller already holds (every page
                  touched, allocated outside the clock, as an engine's parameters are):
                  ``client.load_into(module, transport="grpc")``, in place. No fresh
                  memory: what the receive path costs without page faults.
  streams-2/-4    ``after`` with ``fetch(..., streams=N)``: N concurrent streams (their
                  GB/s is the whole fetch's, not one stream's).
  old-client      baseline client against the new daemon (compatibility, timed too).
  old-server      new client against the baseline daemon (compatibility, timed too).

``--pin`` gives each side a core of its own (the servers one, the clients another): a
row then runs at the speed of its busier side, and its CPU cap is 1 / that side's CPU
seconds per GB, which is what a host where the daemon and the worker do not share
cores would see.

A row's value is the median of --repeat runs; the rows alternate inside each repeat so
drift on this shared machine hits them alike. Besides wall-clock GB/s, the CPU seconds
the server and the client spent per GB are shown: on a 2-core machine the sum of both
is what bounds a stream, and CPU time is far less noisy than wall time. "CPU cap" is
that bound: the cores this process may use divided by both sides' CPU seconds per GB,
the fastest the row could go here even if the two sides overlapped perfectly. Each client
run checks it received every tensor (weightd checks every slice's digest).

A second table carries over to hosts with more cores: the CPU seconds per GB of each
side's busiest thread (``/proc/<pid>/task/*/schedstat`` across the run; gRPC's own
threads, the handler, the receiving Python thread). Where every thread has a core, a
stream is a pipeline that runs at its slowest stage, so 1 / the busier of the two is the
"thread cap", and the ratio of two rows' thread caps is what to expect between them there.

    .venv/bin/python bench/grpc_throughput.py [--size-mb 400] [--world-size 2] [--repeat 5]
        [--baseline-rev 2bd4002] [--rows bare-raw,bare-pb,before,after] [--json FILE] [--pin]

--baseline-rev is main before Fetch pieces were read straight into their messages and
big tensors were populated (bd5332b; 2bd4002 is the one before slice digests were
negotiated, 57b8bc6 the one before Fetch messages were hand-encoded); the
"before"/"old-*" rows need it in the repository's history (``git archive``), the other
rows do not. ``--smoke`` uses tiny tensor widths (tests/bench keeps the script working).
Results and what the profiles showed: docs/notes/2026-12-02-grpc-throughput.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROWS = [
    "bare-raw",
    "bare-pb",
    "before",
    "after-sha256",
    "after",
    "after-rehash",
    "after-into",
    "streams-2",
    "streams-4",
    "old-client",
    "old-server",
]
#: Client options of the rows run with this tree's client: (slice digest kind, streams).
CLIENT_OPTS = {
    "after-sha256": ("sha256", 1),
    "after-into": ("into", 1),
    "streams-2": ("", 2),
    "streams-4": ("", 4),
}
BARE_CHUNK = 1 << 20
BARE_SERVICE = "weightd.bench.Bare"


# --- processes -----------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> dict[int, set[int]]:
    """Each live thread of process ``pid`` and the CPUs it may run on (exited ones skipped)."""
    out: dict[int, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            out[int(task.name)] = os.sched_getaffinity(int(task.name))
    return out


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds each live thread of process ``pid`` has run so far, by thread id.

    From ``schedstat`` (nanoseconds; ``stat``'s clock ticks are 10 ms, a fifth of what
    one thread spends on a 500 MB run). Threads that exited are not there, which is
    why only the busiest thread is read from this, never a sum.
    """
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
    return out


def busiest(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds of the thread that ran most between two :func:`thread_cpu` readings."""
    return max((s - before.get(tid, 0.0) for tid, s in after.items()), default=0.0)


def pin(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` (and the threads they start later) onto ``cpu``.

    Repeated until a pass finds none left elsewhere: a thread an unpinned one started
    meanwhile is caught by the next pass (a process that keeps moving its own threads
    back is refused after 20 passes).
    """
    for _ in range(20):
        others = [t for t, cpus in _threads(pid).items() if cpus != {cpu}]
        if not others:
            return
        for tid in others:
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, {cpu})
    raise SystemExit(f"--pin: process {pid} keeps threads off CPU {cpu}")


def cpus_of(pid: int) -> list[int]:
    """Every CPU some live thread of process ``pid`` may run on."""
    return sorted(set().union(*_threads(pid).values()))


def _env(src: Path | None) -> dict[str, str]:
    """The environment that makes ``import weightd`` resolve to ``src`` (None: this tree)."""
    env = dict(os.environ)
    roots = [src or ROOT]
    env["PYTHONPATH"] = os.pathsep.join(f"{r / 'client'}{os.pathsep}{r / 'server'}" for r in roots)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _wait_for(sock: Path, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}): see {log}")
        if sock.exists():
            return
        time.sleep(0.2)
    raise SystemExit(f"server not ready after 300 s: see {log}")


def start_weightd(
    directory: Path, run: Path, src: Path | None, extra: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``weightd serve`` from ``src`` (None: this tree) on a private socket, once serving."""
    from bench.run import start_daemon

    run.mkdir(mode=0o700)
    log = run.parent / f"{run.name}.log"
    daemon = start_daemon(
        directory, f"unix://{run / 'weightd.sock'}", log, extra=extra, env=_env(src)
    )
    return daemon.process, daemon.target


def start_bare(run: Path, nbytes: int) -> tuple[subprocess.Popen[bytes], str]:
    run.mkdir(mode=0o700)
    sock = run / "bare.sock"
    log = run.parent / f"{run.name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--bare-server", str(sock), "--bare-bytes", str(nbytes)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(None),
        )
    _wait_for(sock, proc, log)
    return proc, f"unix://{sock}"


def bare_server(sock: str, nbytes: int) -> None:
    """Serve ``nbytes`` of random bytes in 1 MiB messages: raw, and as FetchResponse."""
    import grpc

    from weightd.v1 import weightd_pb2 as pb

    pieces = [os.urandom(min(BARE_CHUNK, nbytes - o)) for o in range(0, nbytes, BARE_CHUNK)]

    def raw(request: bytes, context: Any) -> Any:
        yield from pieces

    def protobuf(request: bytes, context: Any) -> Any:
        for i, data in enumerate(pieces):
            resp = pb.FetchResponse()
            resp.chunks.add(index=0, offset=i * BARE_CHUNK, data=data)
            yield resp

    handler = grpc.method_handlers_generic_handler(
        BARE_SERVICE,
        {
            "Raw": grpc.unary_stream_rpc_method_handler(raw),
            "Pb": grpc.unary_stream_rpc_method_handler(
                protobuf, response_serializer=pb.FetchResponse.SerializeToString
            ),
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    server.wait_for_termination()


# --- one client run, in its own process ------------------------------------------------------


def busiest_of(
    threads: tuple[dict[int, float], dict[int, float]], server_pid: int
) -> dict[str, float]:
    """The busiest client and server thread's CPU seconds since the ``threads`` reading."""
    return {
        "client_thread": busiest(threads[0], thread_cpu(os.getpid())),
        "server_thread": busiest(threads[1], thread_cpu(server_pid)),
    }


def child(args: argparse.Namespace) -> None:
    if args.pin_cpu >= 0:
        pin(os.getpid(), args.pin_cpu)
    import torch

    torch.set_num_threads(1)
    import grpc

    if args.child.startswith("bare"):
        from weightd.v1 import weightd_pb2 as pb

        channel = grpc.insecure_channel(
            args.target, options=[("grpc.max_receive_message_length", 16 << 20)]
        )
        grpc.channel_ready_future(channel).result(timeout=30)
        raw = args.child == "bare-raw"
        call = channel.unary_stream(
            f"/{BARE_SERVICE}/{'Raw' if raw else 'Pb'}",
            request_serializer=None,
            response_deserializer=None if raw else pb.FetchResponse.FromString,
        )
        threads = thread_cpu(os.getpid()), thread_cpu(args.server_pid)
        started_cpu = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        nbytes = 0
        for msg in call(b"", timeout=600):
            nbytes += len(msg) if raw else sum(len(c.data) for c in msg.chunks)
        seconds = time.perf_counter() - started
        now = resource.getrusage(resource.RUSAGE_SELF)
        out_threads = busiest_of(threads, args.server_pid)
        tensors = 0
    elif args.slice_digest == "into":
        from bench.load_into import module_for
        from weightd.client import WeightClient

        client = WeightClient(args.target, timeout=600)
        want = client.fetch(args.rank, args.world_size, transport="grpc")  # shapes; the check
        spec = {n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in want.items()}
        module = module_for(spec)  # every parameter allocated and touched, outside the clock
        threads = thread_cpu(os.getpid()), thread_cpu(args.server_pid)
        started_cpu = resource.getrusage(resource.RUSAGE_SELF)
        server_before = _cpu_seconds(args.server_pid)
        started = time.perf_counter()
        client.load_into(module, args.rank, args.world_size, transport="grpc")
        seconds = time.perf_counter() - started
        now = resource.getrusage(resource.RUSAGE_SELF)
        server_cpu = _cpu_seconds(args.server_pid) - server_before
        out_threads = busiest_of(threads, args.server_pid)
        got = dict(module.named_parameters())
        if set(got) != set(want) or not all(torch.equal(got[n], want[n]) for n in want):
            raise SystemExit("after-into: the module does not hold the rank's bytes")
        nbytes = sum(t.numel() * t.element_size() for t in want.values())
        tensors = len(want)
        client.close()
        cpu = (now.ru_utime - started_cpu.ru_utime) + (now.ru_stime - started_cpu.ru_stime)
        out = {"seconds": seconds, "bytes": nbytes, "tensors": tensors, "cpu": cpu}
        out |= {"server_cpu": server_cpu, "cpus": cpus_of(os.getpid())} | out_threads
        print(json.dumps(out))
        return
    else:
        import weightd.client

        opts: dict[str, Any] = {}
        if args.slice_digest:
            opts["slice_digest"] = args.slice_digest
        client = weightd.client.WeightClient(args.target, timeout=600, **opts)
        client.list_models()  # connected before the clock starts
        more = {"streams": args.streams} if args.streams > 1 else {}
        threads = thread_cpu(os.getpid()), thread_cpu(args.server_pid)
        started_cpu = resource.getrusage(resource.RUSAGE_SELF)
        started = time.perf_counter()
        state = client.fetch(args.rank, args.world_size, transport="grpc", **more)
        seconds = time.perf_counter() - started
        now = resource.getrusage(resource.RUSAGE_SELF)
        out_threads = busiest_of(threads, args.server_pid)  # before close: its threads live
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        tensors = len(state)
        client.close()
    cpu = (now.ru_utime - started_cpu.ru_utime) + (now.ru_stime - started_cpu.ru_stime)
    out = {"seconds": seconds, "bytes": nbytes, "tensors": tensors, "cpu": cpu}
    print(json.dumps(out | {"cpus": cpus_of(os.getpid())} | out_threads))


def run_client(
    row: str, target: str, src: Path | None, server_pid: int, args: argparse.Namespace
) -> dict[str, float]:
    kind = row if row.startswith("bare") else "weightd"
    digest, streams = CLIENT_OPTS.get(row, ("", 1))
    cpu_before = _cpu_seconds(server_pid)
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--target",
            target,
            "--rank",
            str(args.rank),
            "--world-size",
            str(args.world_size),
            "--slice-digest",
            digest,
            "--streams",
            str(streams),
            "--server-pid",
            str(server_pid),
            "--pin-cpu",
            str(args.pin_cpus[1] if args.pin else -1),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(src),
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{row}: client failed\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "server_cpu" not in result:  # the child's own window, where it measured one
        result["server_cpu"] = _cpu_seconds(server_pid) - cpu_before
    if args.pin:  # every thread of both sides stayed on its own core, to the end
        sides = {"client": (result["cpus"], args.pin_cpus[1])}
        sides["server"] = (cpus_of(server_pid), args.pin_cpus[0])
        for side, (cpus, cpu) in sides.items():
            if cpus != [cpu]:
                raise SystemExit(f"{row}: --pin: the {side}'s threads may run on {cpus}, not {cpu}")
    return result


# --- the driver ------------------------------------------------------------------------------


def baseline_tree(rev: str, into: Path) -> Path:
    """``client/`` and ``server/`` of ``rev``, exported with ``git archive``."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "client", "server"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sys.path.insert(0, str(ROOT))
    from bench.checkpoint import add_rank_bench_args, warm_rank_checkpoint

    add_rank_bench_args(p)
    p.add_argument("--baseline-rev", default="bd5332b", help="'before' source (git revision)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of rows")
    p.add_argument("--json", type=Path, default=None, help="also write the raw runs here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    p.add_argument("--slice-digest", default="", help=argparse.SUPPRESS)
    p.add_argument("--streams", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pin-cpu", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument(
        "--pin",
        action="store_true",
        help="servers on one CPU, clients on another (the first two this process may use): "
        "a core for each side, as on a host where the daemon and the worker do not share one",
    )
    p.add_argument("--bare-server", help=argparse.SUPPRESS)
    p.add_argument("--bare-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.pin_cpus = sorted(os.sched_getaffinity(0))[:2]
    if args.pin and len(args.pin_cpus) < 2:
        p.error(f"--pin needs two CPUs; this process may use {args.pin_cpus}")
    if args.bare_server:
        bare_server(args.bare_server, args.bare_bytes)
        return
    if args.child:
        child(args)
        return
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        raise SystemExit(f"unknown rows: {sorted(unknown)}")
    directory = warm_rank_checkpoint(args)
    procs: list[subprocess.Popen[bytes]] = []

    def keep(proc: subprocess.Popen[bytes]) -> None:
        """A server started: stopped at the end, and on its own core from now with --pin."""
        procs.append(proc)
        if args.pin:
            pin(proc.pid, args.pin_cpus[0])

    runs: dict[str, list[dict[str, float]]] = {r: [] for r in rows}
    with tempfile.TemporaryDirectory(prefix="weightd-grpc-bench-") as tmp:
        work = Path(tmp)
        try:
            needs_old = {"before", "old-client", "old-server"} & set(rows)
            old_src = baseline_tree(args.baseline_rev, work / "baseline") if needs_old else None
            servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
            if any(r in rows for r in ("before", "old-server")):
                servers["old"] = start_weightd(directory, work / "old", old_src)
                keep(servers["old"][0])
            new_rows = (
                "after",
                "after-sha256",
                "after-into",
                "old-client",
                "streams-2",
                "streams-4",
            )
            if any(r in rows for r in new_rows):
                servers["new"] = start_weightd(directory, work / "new", None)
                keep(servers["new"][0])
            if "after-rehash" in rows:
                servers["rehash"] = start_weightd(
                    directory, work / "rehash", None, ["--fetch-rehash"]
                )
                keep(servers["rehash"][0])
            plan: dict[str, tuple[str, Path | None]] = {
                "before": ("old", old_src),
                "after-sha256": ("new", None),
                "after": ("new", None),
                "after-rehash": ("rehash", None),
                "after-into": ("new", None),
                "streams-2": ("new", None),
                "streams-4": ("new", None),
                "old-client": ("new", old_src),
                "old-server": ("old", None),
            }
            # The bare rows stream as many bytes as the weightd rank holds.
            nbytes = 0
            probe = next((r for r in rows if not r.startswith("bare")), None)
            if probe is not None:
                server, src = plan[probe]
                warm = run_client(probe, servers[server][1], src, servers[server][0].pid, args)
                nbytes = int(warm["bytes"])
            else:
                nbytes = args.size_mb * 1_000_000 // args.world_size
            if any(r.startswith("bare") for r in rows):
                servers["bare"] = start_bare(work / "bare", nbytes)
                keep(servers["bare"][0])
                plan["bare-raw"] = ("bare", None)
                plan["bare-pb"] = ("bare", None)
            for row in rows:  # one unmeasured run each: imports, first-touch, caches
                server, src = plan[row]
                run_client(row, servers[server][1], src, servers[server][0].pid, args)
            for i in range(args.repeat):
                order = rows if i % 2 == 0 else rows[::-1]
                for row in order:
                    server, src = plan[row]
                    r = run_client(row, servers[server][1], src, servers[server][0].pid, args)
                    runs[row].append(r)
                    gbps = r["bytes"] / r["seconds"] / 1e9
                    print(
                        f"  {i + 1}/{args.repeat} {row:<11} {gbps:6.3f} GB/s  server "
                        f"{r['server_cpu']:.2f} s  client {r['cpu']:.2f} s CPU",
                        flush=True,
                    )
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(60)
    tensors = {r: {int(x["tensors"]) for x in runs[r]} for r in rows if not r.startswith("bare")}
    if len({frozenset(v) for v in tensors.values()}) > 1:
        raise SystemExit(f"rows received different tensor counts: {tensors}")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"dir": str(directory)}, "runs": runs}, default=str)
        )
    report(runs, rows, args, nbytes)


def report(
    runs: dict[str, list[dict[str, float]]], rows: list[str], args: argparse.Namespace, nbytes: int
) -> None:
    def med(row: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[row])

    gbps = {r: statistics.median(x["bytes"] / x["seconds"] / 1e9 for x in runs[r]) for r in rows}
    ref = "bare-raw" if "bare-raw" in rows else rows[0]
    base = "before" if "before" in rows and ref != "before" else None
    print(
        f"\nOne stream, TP={args.world_size} rank {args.rank}, {nbytes / 1e6:.0f} MB, Unix socket, "
        f"median of {args.repeat} alternating runs (baseline {args.baseline_rev}):"
    )
    head = f"  {'row':<11}{'GB/s':>8}{'vs ' + ref:>12}"
    head += f"{'vs before':>11}" if base else ""
    head += f"{'server CPU s/GB':>17}{'client CPU s/GB':>17}"
    head += f"{'CPU cap GB/s':>14}{'cap vs ' + ref:>16}"
    print(head)
    cores = len(os.sched_getaffinity(0))
    for r in rows:
        gb = nbytes / 1e9
        line = f"  {r:<11}{gbps[r]:>8.3f}{gbps[r] / gbps[ref]:>11.2f}x"
        if base:
            line += f"{gbps[r] / gbps[base]:>10.2f}x"
        server, client = med(r, "server_cpu") / gb, med(r, "cpu") / gb
        cap = 1 / max(server, client) if args.pin else cores / (server + client)
        line += f"{server:>17.2f}{client:>17.2f}{cap:>14.3f}{cap / gbps[ref]:>15.2f}x"
        print(line)
    if args.pin:
        print(
            "  CPU cap (--pin: a core for each side): 1 / the busier side's CPU s per GB, the "
            "fastest a row\n  could go with that side's core always busy."
        )
    else:
        print(
            f"  CPU cap: {cores} cores (this process's) / both sides' CPU s per GB: the fastest "
            "a row could go here\n  if the two sides overlapped perfectly; a goal above a "
            "row's cap cannot be met on this machine."
        )
    print(
        "\nBusiest thread (CPU s per GB of the one thread that ran most, each side), and the "
        "thread cap:\n1 / the busier of the two, the fastest a row could go on a host where "
        "every thread\nhas a core of its own (a pipeline runs at its slowest stage):"
    )
    print(
        f"  {'row':<11}{'client s/GB':>13}{'server s/GB':>13}{'thread cap GB/s':>17}"
        f"{'vs ' + ref + ' cap':>18}"
    )
    busy = {r: (med(r, "client_thread"), med(r, "server_thread")) for r in rows}
    if not all(min(b) > 0 for b in busy.values()):  # a kernel without per-task schedstat
        print("  (not shown: this kernel reports no per-thread CPU time in schedstat)")
        return
    for r in rows:
        client, server = (s / (nbytes / 1e9) for s in busy[r])
        cap, ref_cap = (nbytes / 1e9 / max(busy[x]) for x in (r, ref))
        print(f"  {r:<11}{client:>13.3f}{server:>13.3f}{cap:>17.2f}{cap / ref_cap:>17.2f}x")


if __name__ == "__main__":
    main()
