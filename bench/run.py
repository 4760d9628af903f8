"""How much faster and lighter is it to get weights from weightd than to load them myself?

One command, one run, peers alternating round by round on the same checkpoint:

    .venv/bin/python -m bench.run                 # ~2 GiB checkpoint, TP 2 and 4, 3 rounds
    .venv/bin/python -m bench.run --size-gb 0.05 --rounds 1 --world-sizes 2   # smoke

For every case, all ranks start together (one process each, one torch thread each) and
the time is until the last rank holds its weights: every page of them in the rank's
page table (a lazily mapped tensor is not "held" until its pages are in the process).
A tensor ``/proc/self/pagemap`` shows mapped when the loader returns is held; every
other tensor has each of its pages read (``--until touched``: every tensor's, mapped or
not, the definition before 2026-12-04, which adds reading memory that is already in
place). A rank that holds its weights then waits until every rank does, as a TP group
does at its first collective, before it measures and exits: before 2026-12-05 it went
on at once, and its reading of smaps and its interpreter's teardown took the cores from
the ranks still loading (at TP=4 on two cores the last shared-memory rank finished
markedly later; the dated notes in ``docs/notes/`` have the figures). Memory is read from
``/proc/<pid>/smaps_rollup`` after loading (PSS and private bytes, since RSS counts
shared pages once per process) and I/O from ``/proc/<pid>/io``. Results go to
``bench/results/<timestamp>/`` as results.json, results.md and chart.png. No timing is
asserted anywhere: machines are shared and noisy, so read the ratios.

Warm means warm for the host too: each timed warm run of a case follows an untimed run
of the same case (``--no-rewarm``: not). Why: this VM's host reclaims guest memory left
idle; a shared-memory pack untouched for half a minute took many times longer to touch
than right after a fetch (docs/notes/2026-12-02-grpc-throughput.md). The checkpoint's
page cache is read by most cases, so it stays hot anyway, while a pack is read by one
case once a round: without the untimed run, the fast rows measured the host's
page-ins, and the rows that share the page cache were favoured.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import importlib.util
import json
import mmap
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.checkpoint import SMOKE, TINYLLAMA, make_checkpoint
from bench.shmem import can_set_modes, host_mode, host_mode_set

ROOT = Path(__file__).resolve().parent.parent
PEERS = ["read-everything", "lazy-mmap", "best-local", "runai-streamer", "fastsafetensors"]
#: Peers that need a package of their own (the ``bench`` extra); skipped when it is absent.
PEER_PACKAGES = {"runai-streamer": "runai_model_streamer", "fastsafetensors": "fastsafetensors"}


def available_peers() -> list[str]:
    """The peers whose packages are importable here, in :data:`PEERS` order."""
    out = []
    for peer in PEERS:
        package = PEER_PACKAGES.get(peer)
        if package is None or importlib.util.find_spec(package) is not None:
            out.append(peer)
        else:
            print(f"peer {peer} skipped: {package} is not installed (pip install '.[bench]')")
    return out


# --- page cache ------------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache (mincore; touches nothing)."""
    size = path.stat().st_size
    if size == 0:
        return 1.0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        page = mmap.PAGESIZE
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        base = ctypes.c_void_p(_mmap_address(mm))
        if _libc.mincore(base, ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vec) / pages


def _mmap_address(mm: mmap.mmap) -> int:
    # A read-only mmap refuses writable buffer exports; a memoryview's address via ctypes
    # of a read-only buffer needs PyObject_GetBuffer, which ctypes.pythonapi exposes.
    class Py_buffer(ctypes.Structure):  # noqa: N801 - the C name
        _fields_ = [
            ("buf", ctypes.c_void_p),
            ("obj", ctypes.py_object),
            ("len", ctypes.c_ssize_t),
            ("itemsize", ctypes.c_ssize_t),
            ("readonly", ctypes.c_int),
            ("ndim", ctypes.c_int),
            ("format", ctypes.c_char_p),
            ("shape", ctypes.c_void_p),
            ("strides", ctypes.c_void_p),
            ("suboffsets", ctypes.c_void_p),
            ("internal", ctypes.c_void_p),
        ]

    view = Py_buffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(mm), ctypes.byref(view), 0)
    try:
        return int(view.buf)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[Path]) -> float:
    """Read every file once; return GB/s (the warm page-cache read ceiling when warm)."""
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    total = 0
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            off = 0
            while n := os.preadv(fd, [view], off):
                off += n
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t) / 1e9


def copy_bandwidth() -> float:
    """memcpy into memory that already exists, GB/s (median of 5)."""
    src = np.ones(256 << 20, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        runs.append(src.nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(runs)


# --- the daemon ------------------------------------------------------------------------


@dataclass
class Daemon:
    process: subprocess.Popen[bytes]
    target: str
    log: Path
    ready_seconds: float


def start_daemon(
    ckpt: Path,
    listen: str,
    log: Path,
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Daemon:
    """``weightd serve`` on ``ckpt`` (model ``bench``), returned once it logs ``serving``.

    ``env``: the daemon's environment (None: this process's), e.g. a PYTHONPATH that
    runs another version of weightd side by side.
    """
    cmd = [sys.executable, "-m", "weightd.server.cli.main", "serve", "--model", f"bench={ckpt}"]
    cmd += ["--listen", listen, *(extra or [])]
    t = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    target = ""
    while time.monotonic() - t < 600:
        text = log.read_text(errors="replace")
        m = re.search(r"serving models=\S+ target=(\S+)", text)
        if m:
            target = m.group(1)
            break
        if proc.poll() is not None:
            raise RuntimeError(f"daemon died:\n{text}")
        time.sleep(0.02)
    if not target:
        raise RuntimeError("daemon not serving after 600 s")
    return Daemon(proc, target, log, time.monotonic() - t)


def stop_daemon(d: Daemon) -> None:
    d.process.send_signal(signal.SIGTERM)
    try:
        d.process.wait(60)
    except subprocess.TimeoutExpired:
        d.process.kill()
        d.process.wait()


def _cuda_available() -> bool:
    """CUDA usable by this host's torch (checked in a child: this process stays CUDA-free)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def verify_seconds(log: Path) -> float | None:
    m = re.search(r"verified model=\S+ .*seconds=([0-9.]+)", log.read_text(errors="replace"))
    return float(m.group(1)) if m else None


# --- cases -----------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    target: str = ""
    transport: str = "grpc"
    #: The host's ``shmem_enabled`` while this case runs ("": leave it as it is).
    shmem: str = ""

    @property
    def is_weightd(self) -> bool:
        return self.name.startswith("weightd")


@dataclass
class Result:
    case: str
    world_size: int
    cache: str
    seconds: float
    ranks: list[dict[str, Any]] = field(default_factory=list)


def run_case(
    case: Case, ckpt: Path, ws: int, cache: str, digest: bool = False, until: str = "resident"
) -> Result:
    if case.shmem:
        with host_mode_set(case.shmem):
            return _run_case(case, ckpt, ws, cache, digest, until)
    return _run_case(case, ckpt, ws, cache, digest, until)


def _until_line(p: subprocess.Popen[str], word: str) -> str | None:
    """Read ``p``'s output up to a line ``word`` (None), or what it said before it ended."""
    assert p.stdout is not None
    said = []
    for line in p.stdout:
        if line.strip() == word:
            return None
        said.append(line)  # a peer's library may print while it loads
    return "".join(said)


def _run_case(case: Case, ckpt: Path, ws: int, cache: str, digest: bool, until: str) -> Result:
    procs = []
    for rank in range(ws):
        cmd = [sys.executable, "-m", "bench.worker", "--case", case.name, "--ckpt", str(ckpt)]
        cmd += ["--rank", str(rank), "--world-size", str(ws), "--target", case.target]
        cmd += ["--transport", case.transport, "--until", until]
        cmd += ["--digest"] if digest else []
        procs.append(
            subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
            )
        )
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"{case.name} rank did not start: {line!r}")
    go = time.monotonic()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:  # every rank holds its weights before any measures or exits
        said = _until_line(p, "done")
        if said is not None:
            for q in procs:
                q.kill()
            out, _ = p.communicate(timeout=60)
            raise RuntimeError(f"{case.name} ws={ws} failed: {(said + out)[-2000:]}")
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("report\n")
        p.stdin.flush()
    ranks = []
    for p in procs:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{case.name} ws={ws} failed: {out[-2000:]}")
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    seconds = max(r["done"] for r in ranks) - go
    return Result(case.name, ws, cache, seconds, ranks)


# --- report ----------------------------------------------------------------------------


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f}"


def summarize(results: list[Result]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r.case, r.world_size, r.cache) for r in results}, key=lambda k: (k[2], k[1]))
    for case, ws, cache in keys:
        rs = [r for r in results if (r.case, r.world_size, r.cache) == (case, ws, cache)]
        times = [r.seconds for r in rs]
        last = rs[-1].ranks
        payload = sum(x["payload_bytes"] for x in last)
        rows.append(
            {
                "case": case,
                "world_size": ws,
                "cache": cache,
                "rounds": len(times),
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "payload_bytes": payload,
                # Bytes the kernel showed mapped when the loader returned (not touched).
                "proven_resident_bytes": sum(x.get("proven_resident_bytes", 0) for x in last),
                "throughput_gbps": payload / statistics.median(times) / 1e9,
                "sum_pss_delta": sum(x["mem_after"]["pss"] - x["mem_before"]["pss"] for x in last),
                "sum_private_delta": sum(
                    x["mem_after"]["private"] - x["mem_before"]["private"] for x in last
                ),
                "sum_anon_delta": sum(
                    x["mem_after"]["anon"] - x["mem_before"]["anon"] for x in last
                ),
                "max_peak_rss": max(x["mem_after"]["peak_rss"] for x in last),
                "sum_rchar": sum(x["io"].get("rchar", 0) for x in last),
                "sum_read_bytes": sum(x["io"].get("read_bytes", 0) for x in last),
            }
        )
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        if not row["case"].startswith("weightd"):
            continue
        for peer in rows:
            if peer["case"] in PEERS and (peer["world_size"], peer["cache"]) == (
                row["world_size"],
                row["cache"],
            ):
                out.append(
                    {
                        "weightd": row["case"],
                        "peer": peer["case"],
                        "world_size": row["world_size"],
                        "cache": row["cache"],
                        "time_ratio": row["median_s"] / peer["median_s"],
                        "anon_ratio": (row["sum_anon_delta"] / peer["sum_anon_delta"])
                        if peer["sum_anon_delta"] > 0
                        else None,
                    }
                )
    return out


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], rats: list[dict[str, Any]]) -> str:
    lines = [
        f"Checkpoint: {meta['checkpoint_bytes'] / 2**30:.2f} GiB bf16, {meta['shards']} shards; "
        f"machine: {meta['machine']}; copy {meta['copy_gbps']:.1f} GB/s, warm read "
        f"{meta['warm_read_gbps']:.1f} GB/s; eviction {meta['eviction']}; shmem_enabled "
        f"{meta.get('shmem_enabled', '?')} (a weightd-shm-MODE case ran with the host in MODE); "
        + (
            "each warm run timed right after an untimed run of the same case."
            if meta.get("rewarm", False)
            else "warm runs timed without an untimed run before each (--no-rewarm)."
        ),
        "",
        (
            "Time: until the last rank has every page of its weights in its page table "
            "(a tensor /proc/self/pagemap shows mapped when the loader returns is not "
            "touched; the others are, every page; `mapped` is the share shown mapped)."
            if meta.get("until", "touched") == "resident"
            else "Time: until the last rank has read one byte of every page of its weights."
        ),
        "",
        "| case | TP | cache | median s | min-max s | GB/s (x copy bw) | mapped | Σ PSS Δ MB "
        "| Σ private Δ MB | Σ anon Δ MB | max peak RSS MB | Σ read() MB | Σ disk MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['world_size']} | {r['cache']} | {r['median_s']:.3f} | "
            f"{r['min_s']:.3f}-{r['max_s']:.3f} | {r['throughput_gbps']:.2f} "
            f"({r['throughput_gbps'] / meta['copy_gbps']:.2f}) | "
            f"{r.get('proven_resident_bytes', 0) / r['payload_bytes']:.0%} | "
            f"{_mb(r['sum_pss_delta'])} | "
            f"{_mb(r['sum_private_delta'])} | {_mb(r['sum_anon_delta'])} | "
            f"{_mb(r['max_peak_rss'])} | {_mb(r['sum_rchar'])} | "
            f"{_mb(r['sum_read_bytes'])} |"
        )
    lines += ["", "Ratios (weightd ÷ peer; < 1 is better for weightd):", ""]
    lines += [
        "| weightd | peer | TP | cache | time | own (anon) memory |",
        "|---|---|---|---|---|---|",
    ]
    for q in rats:
        priv = "—" if q["anon_ratio"] is None else f"{q['anon_ratio']:.2f}"
        lines.append(
            f"| {q['weightd']} | {q['peer']} | {q['world_size']} | {q['cache']} | "
            f"{q['time_ratio']:.2f} | {priv} |"
        )
    d = meta["daemon"]
    lines += [
        "",
        f"Daemon: cold start to SERVING {d['cold_start_s']:.2f} s (verify {d['cold_verify_s']} s; "
        f"reading the checkpoint once cold took {d['cold_read_s']:.2f} s); restart on the "
        f"unchanged checkpoint {d['restart_s']:.2f} s (verify {d['restart_verify_s']} s); "
        f"hashing {d['hash_gbps']:.2f} GB/s. First fetch per TP size (anchors slice digests): "
        + ", ".join(f"TP={k}: {v:.2f} s" for k, v in d["first_fetch_s"].items())
        + ".",
    ]
    return "\n".join(lines) + "\n"


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["world_size"], r["cache"]) for r in rows})
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(max(7, 2.2 * len(groups) + 3), 8), sharex=True)
    width = 0.8 / len(cases)
    for i, case in enumerate(cases):
        ys, ms = [], []
        for g in groups:
            match = [r for r in rows if (r["world_size"], r["cache"]) == g and r["case"] == case]
            ys.append(match[0]["median_s"] if match else 0)
            # Own (anonymous) memory per worker: its private copy, not shared pages.
            ms.append(match[0]["sum_anon_delta"] / g[0] / 1e6 if match else 0)
        xs = [j + i * width for j in range(len(groups))]
        ax.bar(xs, ys, width, label=case)
        mem.bar(xs, ms, width, label=case)
    mem.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    mem.set_xticklabels([f"TP={ws} {cache}" for ws, cache in groups])
    ax.set_ylabel("seconds until every rank holds\nits weights, every page resident\n(median)")
    ax.set_yscale("log")
    mem.set_ylabel("private (anonymous) memory\nper worker, MB")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt", type=Path, help="use this checkpoint instead of generating one")
    p.add_argument("--size-gb", type=float, default=2.0)
    p.add_argument(
        "--smoke", action="store_true", help="tiny widths (hidden 256), to check the bench works"
    )
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/weightd-bench"))
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache round")
    p.add_argument(
        "--no-rewarm",
        action="store_true",
        help="time each warm run without running the case untimed just before it",
    )
    p.add_argument(
        "--until",
        choices=("resident", "touched"),
        default="resident",
        help="resident (default): time until every page is in each rank's page table,\n"
        "touching only what /proc/self/pagemap does not show mapped; touched: every page\n"
        "of every tensor read, mapped or not",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument(
        "--shm-modes",
        default="",
        help="also run weightd-shm-MODE for each of these shmem_enabled modes (e.g. advise):\n"
        "a daemon of its own started in that mode, the host set to it around each of its\n"
        "runs and restored afterwards (root; the host's own mode is the weightd-shm case)",
    )
    args = p.parse_args(argv)
    shm_modes = [m for m in args.shm_modes.split(",") if m and m != host_mode()]
    if shm_modes and not can_set_modes():
        p.error("--shm-modes needs root and a writable shmem_enabled")

    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    widths = SMOKE if args.smoke else TINYLLAMA
    ckpt = args.ckpt or make_checkpoint(work / "ckpt", int(args.size_gb * 2**30), widths=widths)
    shards = sorted(ckpt.glob("*.safetensors"))
    total = sum(s.stat().st_size for s in shards)
    print(f"checkpoint {ckpt}: {total / 2**30:.2f} GiB in {len(shards)} shards", flush=True)

    copy_gbps = copy_bandwidth()
    evict(shards)
    evicted = max(resident_fraction(s) for s in shards) < 0.05
    t = time.perf_counter()
    warm(shards)
    cold_read = time.perf_counter() - t
    warm_read_gbps = warm(shards)

    # Daemon start-up: cold (page cache evicted) and a restart on the unchanged files.
    evict(shards)
    sock = work / "run" / "weightd.sock"
    # On a GPU host the Unix daemon also places packs on the GPU (CUDA IPC case).
    gpu = _cuda_available()
    unix_flags = ["--cuda-ipc"] if gpu else []
    # Packs outlive the default 5-minute TTL between rounds on a slow (shared) machine, so
    # the shared-memory case measures a built pack, never a rebuild.
    unix_flags += ["--pack-ttl", "7200"]
    unix = start_daemon(ckpt, f"unix://{sock}", work / "daemon-unix.log", unix_flags)
    cold_start, cold_verify = unix.ready_seconds, verify_seconds(unix.log)
    stop_daemon(unix)
    unix = start_daemon(ckpt, f"unix://{sock}", work / "daemon-unix.log", unix_flags)
    restart, restart_verify = unix.ready_seconds, verify_seconds(unix.log)
    tcp = start_daemon(
        ckpt, "127.0.0.1:0", work / "daemon-tcp.log", ["--insecure", "--admin-listen", "none"]
    )
    cases = [Case(n) for n in available_peers()] + [
        Case("weightd-grpc-unix", unix.target, "grpc"),
        Case("weightd-grpc-tcp", tcp.target, "grpc"),
        Case("weightd-shm", unix.target, "shm"),
    ]
    if gpu:
        cases.append(Case("weightd-cuda-ipc", unix.target, "cuda_ipc"))
    results: list[Result] = []
    first_fetch: dict[int, float] = {}
    moded: list[Daemon] = []
    try:
        # A daemon per extra shmem mode: it reads the mode at start and builds its packs
        # in the first round, with the host in that mode (Case.shmem).
        for mode in shm_modes:
            with host_mode_set(mode):
                d = start_daemon(
                    ckpt,
                    f"unix://{work / f'run-{mode}' / 'weightd.sock'}",
                    work / f"daemon-{mode}.log",
                    ["--pack-ttl", "7200"],
                )
            moded.append(d)
            cases.append(Case(f"weightd-shm-{mode}", d.target, "shm", shmem=mode))
        # A first round per TP size, reported apart ("first"): the first fetch of a
        # layout anchors the slice digests (reads each tensor whole once), and every
        # rank hashes what it got, proving all cases deliver the same bytes.
        for ws in args.world_sizes:
            digests: dict[str, list[str]] = {}
            for case in cases:
                r = run_case(case, ckpt, ws, "first", digest=True, until=args.until)
                results.append(r)
                if case.name == "weightd-grpc-unix":
                    first_fetch[ws] = r.seconds
                digests[case.name] = [x["digest"] for x in r.ranks]
            if len({tuple(v) for v in digests.values()}) != 1:
                raise RuntimeError(f"cases disagree on the bytes at TP={ws}: {digests}")
            print(f"TP={ws}: all {len(cases)} cases deliver identical slices", flush=True)
        for rnd in range(args.rounds):
            for ws in args.world_sizes:
                order = cases[rnd % len(cases) :] + cases[: rnd % len(cases)]  # alternate
                for case in order:
                    if not args.no_rewarm:
                        # untimed: hot in the guest and host
                        run_case(case, ckpt, ws, "warm", until=args.until)
                    results.append(run_case(case, ckpt, ws, "warm", until=args.until))
                    print(
                        f"round {rnd} TP={ws} {case.name}: {results[-1].seconds:.3f}s", flush=True
                    )
        if not args.no_cold:
            ws = args.world_sizes[0]
            for case in cases:
                evict(shards)
                results.append(run_case(case, ckpt, ws, "cold", until=args.until))
                print(f"cold TP={ws} {case.name}: {results[-1].seconds:.3f}s", flush=True)
    finally:
        for d in [unix, tcp, *moded]:
            stop_daemon(d)

    rows = summarize(results)
    rats = ratios(rows)
    meta = {
        "checkpoint": str(ckpt),
        "checkpoint_bytes": total,
        "shards": len(shards),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, {platform.platform()}",
        "copy_gbps": copy_gbps,
        "warm_read_gbps": warm_read_gbps,
        "eviction": "worked (posix_fadvise DONTNEED)" if evicted else "did NOT work: cold = warm",
        "shmem_enabled": host_mode(),
        "rewarm": not args.no_rewarm,
        "until": args.until,
        "daemon": {
            "cold_start_s": cold_start,
            "cold_verify_s": cold_verify,
            "cold_read_s": cold_read,
            "restart_s": restart,
            "restart_verify_s": restart_verify,
            "hash_gbps": total / cold_verify / 1e9 if cold_verify else 0.0,
            "first_fetch_s": first_fetch,
        },
    }
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {"meta": meta, "rows": rows, "ratios": rats, "raw": [r.__dict__ for r in results]},
            indent=2,
        )
    )
    md = markdown(meta, rows, rats)
    (out / "results.md").write_text(md)
    chart(rows, out / "chart.png")
    print(md)
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
