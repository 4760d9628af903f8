"""weightd's LoRA adapters in vLLM's OpenAI server, measured against vLLM's own route.

Run from the project's venv (it makes the base and the PEFT adapters, runs ``weightd
serve``); vLLM runs from ``.venv-vllm``::

    .venv/bin/python bench/vllm_lora.py --rounds 3 --swaps 50 --engines 2 --json out.json

One API server (``--middleware ...WeightdLoRAMiddleware``, and vLLM's filesystem
resolver beside it: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``,
``VLLM_LORA_RESOLVER_CACHE_DIR``) measures, alternating the two routes in one run:

1. **first request for an adapter not loaded yet** (a fresh name each time, its files
   just written so both read from the page cache), one token, the load average on
   each row: through weightd (the daemon loads and verifies it from its root, builds
   its sealed pack, vLLM's worker maps and re-verifies it and builds the adapter from
   it; with ``--handover files``, the API server fetches the files over gRPC and writes
   its private copy for vLLM to read, as before issue 45) and through vLLM's filesystem
   resolver (vLLM reads the directory), for a small adapter and one of >= 100 MB;
2. **hot-swap latency**: from the start of the operator's ``LoadAdapter`` of a new
   version to the first response generated with it (the response's ``model`` names
   the version), over ``--swaps`` swaps; p50 / p99.

Then ``--engines`` API servers each take the same adapters (through weightd, then the
same contents through the filesystem resolver) and the host memory is read:
each server's process tree (PSS, ``smaps_rollup``), the daemon's, and the private
copies on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lora_adapters import make_adapter, make_base  # noqa: E402
from bench.vllm_api import CPU_ARGS, ApiServer, api_server  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MIDDLEWARE = "weightd.vllm.lora.middleware.WeightdLoRAMiddleware"
#: A base wide enough for an adapter of >= 100 MB at r=256 (fp32, every projection).
BIG_BASE: dict[str, Any] = dict(
    vocab_size=1000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
PROMPT = [1, 5, 9, 200, 7]


def pss_tree(pid: int, *, alone: bool = False) -> int:
    """PSS bytes of ``pid`` and every descendant (the API server, engine core, workers);
    ``alone``: of ``pid`` only."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += [] if alone else children.get(p, [])
        with contextlib.suppress(OSError), open(f"/proc/{p}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    return total


def pss_split(s: ApiServer) -> tuple[int, int]:
    """(PSS of the API server process alone, PSS of its whole tree)."""
    return pss_tree(s.process.pid, alone=True), pss_tree(s.process.pid)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextlib.contextmanager
def daemon(tmp: Path, base: Path, root: Path) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    tmp.mkdir(exist_ok=True)
    run = tmp / "run"
    run.mkdir(mode=0o700)
    log = open(tmp / "daemon.log", "w")  # noqa: SIM115
    cmd = [
        sys.executable,
        *("-m", "weightd.server.cli.main", "serve", "--model", f"base={base}"),
        *("--listen", f"unix://{run}/w.sock", "--adapter-root", str(root)),
        *("--adapter-autoload", "w-*", "--adapter-autoload-trust-roots"),
    ]
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp / "cache"))
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        from weightd.client import WeightClient

        deadline = time.monotonic() + 300
        target = f"unix://{run}/w.sock"
        while True:
            with contextlib.suppress(Exception), WeightClient(target, timeout=5) as c:
                if c.list_models():
                    break
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError((tmp / "daemon.log").read_text()[-4000:])
            time.sleep(0.2)
        yield f"unix://{run}/w.sock", f"unix://{run}/admin.sock", process
    finally:
        process.terminate()
        process.wait(60)
        log.close()


def server_args(max_cpu_loras: int) -> list[str]:
    return [
        *CPU_ARGS,
        *("--max-model-len", "256", "--dtype", "float32", "--seed", "0"),
        *("--enable-lora", "--max-loras", "2", "--max-lora-rank", "256"),
        *("--max-cpu-loras", str(max_cpu_loras), "--middleware", MIDDLEWARE),
    ]


#: ``WEIGHTD_LORA``'s ``handover`` for the weightd route (``--handover``): ``auto`` maps
#: the daemon's sealed pack in vLLM's workers (this host has the side socket), ``files``
#: writes the private copy vLLM then reads (the hand-over before issue 45).
HANDOVER = ["auto"]


def server_env(target: str, copies: Path, fsdir: Path) -> dict[str, str]:
    lora = {"target": target, "dir": str(copies), "handover": HANDOVER[0]}
    return dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        WEIGHTD_LORA=json.dumps(lora),
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
        VLLM_LORA_RESOLVER_CACHE_DIR=str(fsdir),
    )


def first_request(s: ApiServer, name: str) -> float:
    started = time.monotonic()
    s.complete(name, PROMPT, 1)
    return time.monotonic() - started


def copy_as(source: Path, where: Path, name: str) -> str:
    shutil.copytree(source, where / name)
    return name


def loadavg() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def measure_first(
    s: ApiServer, adapters: dict[str, Path], root: Path, fsdir: Path, rounds: int
) -> dict[str, Any]:
    # Not counted: each route's first use in this server (connections, imports, the
    # check of the base model against the daemon's).
    first_request(s, copy_as(adapters["small"], root, "w-warmup"))
    first_request(s, copy_as(adapters["small"], fsdir, "f-warmup"))
    out: dict[str, Any] = {}
    for r in range(rounds):
        for size, source in adapters.items():
            routes = ["weightd", "filesystem"] if r % 2 == 0 else ["filesystem", "weightd"]
            for route in routes:
                where, prefix = (root, "w") if route == "weightd" else (fsdir, "f")
                name = copy_as(source, where, f"{prefix}-{size}-{r}")
                seconds = first_request(s, name)
                warm = first_request(s, name)  # loaded now: the request's own cost
                parts = weightd_parts(s.log(), name) if route == "weightd" else {}
                load = loadavg()
                out.setdefault(f"{size}/{route}", []).append((seconds, warm, parts, load))
                print(
                    f"first request {size:5} {route:10} {seconds:.3f} s (then {warm:.3f} s) "
                    f"{parts} load {load}"
                )
    return out


def weightd_parts(log: str, name: str) -> dict[str, float]:
    """From the API server's log: fetching and writing the private copy (``files``) or
    a worker mapping and verifying the daemon's pack (shared), vLLM's add_lora."""
    out: dict[str, float] = {}
    for key, pattern in (
        (
            "fetch_write",
            rf"adapter '{name}' version \d+ \(\S+\) verified and written .* in (\S+) s",
        ),
        ("lease_check", rf"adapter '{name}' version \d+ \(\S+\): vLLM's .* checked in (\S+) s"),
        ("map_verify", rf"adapter '{name}' version \d+ mapped from .* in (\S+) s"),
        ("add_lora", rf"adapter '{name}' version \d+ \(\S+\) serves new .* in (\S+) s"),
    ):
        found = re.findall(pattern, log)
        if found:
            out[key] = float(found[-1])
    return out


def measure_swaps(s: ApiServer, admin_target: str, sources: list[Path], swaps: int) -> Any:
    from weightd.client.api.admin import AdminClient

    admin = AdminClient(admin_target, timeout=300)
    admin.load_adapter("hs", str(sources[0]))
    s.complete("hs", PROMPT, 1)
    total, loads = [], []
    for i in range(swaps):
        started = time.monotonic()
        v = admin.load_adapter("hs", str(sources[(i + 1) % 2])).version
        loaded = time.monotonic()
        while s.complete("hs", PROMPT, 1)["model"] != f"hs@v{v}":
            pass
        total.append(time.monotonic() - started)
        loads.append(loaded - started)
    return total, loads


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_memory(
    engines: int,
    base: Path,
    target: str,
    tmp: Path,
    adapters: dict[str, Path],
    root: Path,
    fsdir: Path,
    daemon_pid: int,
) -> dict[str, Any]:
    names = {size: copy_as(src, root, f"w-mem-{size}") for size, src in adapters.items()}
    fs_names = {size: copy_as(src, fsdir, f"f-mem-{size}") for size, src in adapters.items()}
    rows: dict[str, Any] = {"engines": engines, "per_engine": []}
    with contextlib.ExitStack() as stack:
        servers = []
        for i in range(engines):
            copies = tmp / f"copies-mem-{i}"
            servers.append(
                stack.enter_context(
                    api_server(
                        VLLM_PYTHON,
                        base,
                        server_args(8),
                        tmp / f"server-mem-{i}.log",
                        server_env(target, copies, fsdir),
                    )
                )
            )
        routes = {"weightd": list(names.values()), "filesystem": list(fs_names.values())}
        for i, s in enumerate(servers):
            # Alternate which route loads first: the first load into an engine also pays
            # its allocator's high-water mark, which the second then reuses.
            order = ["weightd", "filesystem"] if i % 2 == 0 else ["filesystem", "weightd"]
            row: dict[str, Any] = {"order": order, "steps": [("before", *pss_split(s))]}
            for route in order:
                for name in routes[route]:
                    s.complete(name, PROMPT, 1)
                row["steps"].append((f"after {route}", *pss_split(s)))
            row["private_copies_bytes"] = du(tmp / f"copies-mem-{i}")
            rows["per_engine"].append(row)
        rows["daemon_pss"] = pss_tree(daemon_pid)
        rows["adapter_bytes"] = sum(du(p) for p in adapters.values())
    return rows


def run_latency(
    args: argparse.Namespace,
    result: dict[str, Any],
    tmp: Path,
    base: Path,
    adapters: dict[str, Path],
    second: Path,
) -> None:
    """Parts 1 and 2: first requests, alternating routes, then hot-swaps."""
    root, fsdir = tmp / "root", tmp / "fs"
    root.mkdir()
    with (
        daemon(tmp / "d1", base, root) as (target, admin_target, _),
        api_server(
            VLLM_PYTHON,
            base,
            server_args(4),
            tmp / "server.log",
            server_env(target, tmp / "copies", fsdir),
        ) as s,
    ):
        result["first"] = measure_first(s, adapters, root, fsdir, args.rounds)
        sources = (adapters["small"], second)
        pair = [root / copy_as(src, root, f"hs-{i}") for i, src in enumerate(sources)]
        total, loads = measure_swaps(s, admin_target, pair, args.swaps)
        result["swap_seconds"], result["swap_load_seconds"] = total, loads
        p50, p99 = percentile(total, 0.5) * 1e3, percentile(total, 0.99) * 1e3
        print(
            f"hot-swap publish -> first response on it, {len(total)} swaps: "
            f"p50 {p50:.1f} ms, p99 {p99:.1f} ms "
            f"(LoadAdapter p50 {percentile(loads, 0.5) * 1e3:.1f} ms)"
        )
    result["load_mid"] = loadavg()


def run_memory(
    args: argparse.Namespace,
    result: dict[str, Any],
    tmp: Path,
    base: Path,
    adapters: dict[str, Path],
) -> None:
    """Part 3, with a fresh daemon: it holds only the adapters these engines ask for."""
    root2, fsdir = tmp / "root2", tmp / "fs"
    root2.mkdir()
    with daemon(tmp / "d2", base, root2) as (target, _, dproc):
        result["memory"] = measure_memory(
            args.engines, base, target, tmp, adapters, root2, fsdir, dproc.pid
        )
        print(json.dumps(result["memory"], indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--swaps", type=int, default=50)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--only", choices=("all", "latency", "memory"), default="all")
    p.add_argument("--handover", choices=("auto", "files"), default="auto")
    args = p.parse_args()
    HANDOVER[0] = args.handover
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    result["load_start"] = loadavg()
    result["handover"] = args.handover
    with tempfile.TemporaryDirectory(prefix="vllm-lora-bench-") as top:
        tmp = Path(top)
        base = make_base(tmp / "base", BIG_BASE)
        made = tmp / "made"
        adapters = {
            "small": make_adapter(base, made / "small", 1, 8),
            "large": make_adapter(base, made / "large", 2, 256),
        }
        second = make_adapter(base, made / "small-b", 3, 8)
        sizes = {k: du(v) for k, v in adapters.items()}
        print(f"adapters: {sizes} bytes; load {loadavg()}")
        assert sizes["large"] >= 100e6, sizes
        result["adapter_bytes"] = sizes
        (tmp / "fs").mkdir()
        if args.only in ("all", "latency"):
            run_latency(args, result, tmp, base, adapters, second)
        if args.only in ("all", "memory"):
            run_memory(args, result, tmp, base, adapters)
    result["load_end"] = loadavg()
    result["ended"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
