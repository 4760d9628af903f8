"""vLLM loading one checkpoint from weightd and from disk, TP=1 and TP=2, alternating.

    .venv-vllm/bin/python bench/vllm_load.py [--rounds 1] [--tp 1,2] [--layers 10]

Writes a deterministic random Llama-style checkpoint with GQA (TinyLlama widths, 32
query / 4 kv heads, bf16; 10 layers: 1.14 GB) into a temporary directory (never a
download, never committed), serves it with ``weightd serve`` on a private Unix socket,
and for each round starts one vLLM engine per (TP size, loader) in its own process,
alternating weightd and vLLM's default safetensors loader. Per engine: the weight
loading time vLLM's loader logs (``Loading weights took ... seconds``: the default
loader's own line, and the same line from weightd's loader), the time from creating
``LLM(...)`` to the first generated token, and per worker its peak RSS (``VmHWM``),
private memory (``smaps_rollup`` Private_*) and bytes read (``/proc/self/io``
``rchar``: read() calls, and ``read_bytes``: from the disk; pages a loader maps and
touches are in neither, so the default loader's mmap reads show as the pages it
touches, i.e. in its private/RSS figures), all read inside each worker through vLLM's
worker RPC right after the first token.

The page cache is warm for both loaders (the daemon reads the checkpoint at start-up;
the first round's default loader may pay a cold read: alternate and read later
rounds). On these 2-core machines TP=2 runs two workers on one core each, so the
``--timeout`` bounds each engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = [1, 306, 4966, 304, 1827]


def worker_stats(worker: Any) -> dict[str, int]:
    """Inside a vLLM worker: peak RSS, private memory, bytes read."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                out["peak_rss"] = int(line.split()[1]) * 1024
    private = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1]) * 1024
    out["private"] = private
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            if key in ("rchar", "read_bytes"):
                out[key] = int(value)
    report = getattr(worker.model_runner.model, "weightd_load_report", None)
    out["weightd_bytes"] = report.bytes if report is not None else 0
    return out


def child(args: argparse.Namespace) -> None:
    """One engine: print a JSON line with its timings and per-worker figures."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if args.tp == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM, SamplingParams

    extra = {"target": args.target} if args.loader == "weightd" else {}
    t0 = time.perf_counter()
    llm = LLM(
        model=args.dir,
        load_format=args.loader,
        model_loader_extra_config=extra,
        tensor_parallel_size=args.tp,
        gpu_memory_utilization=args.mem,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        dtype="bfloat16",
    )
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False
    )
    first_token = time.perf_counter() - t0
    stats = llm.collective_rpc(worker_stats)
    print(
        "RESULT "
        + json.dumps(
            {"first_token_s": first_token, "workers": stats, "token": out[0].outputs[0].token_ids}
        ),
        flush=True,
    )
    llm.llm_engine.engine_core.shutdown()


def run_one(args: argparse.Namespace, directory: Path, target: str, tp: int, loader: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        *("--dir", str(directory), "--target", target, "--tp", str(tp)),
        *("--loader", loader, "--mem", str(args.mem)),
    ]
    try:
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"tp": tp, "loader": loader, "error": f"timed out after {args.timeout} s"}
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        return {"tp": tp, "loader": loader, "error": proc.stderr[-3000:]}
    result = json.loads(line[len("RESULT ") :])
    log = proc.stdout + proc.stderr  # vLLM's workers log to stdout
    loads = [float(x) for x in re.findall(r"Loading weights took ([\d.]+) seconds", log)]
    result.update(tp=tp, loader=loader, load_s=max(loads) if loads else None)
    return result


def table(results: list[dict]) -> str:
    rows = [
        "| TP | loader | weights loaded (s, vLLM's line) | LLM() to first token (s) | "
        "peak RSS / worker (MiB) | private / worker (MiB) | rchar / worker (MiB) | "
        "read_bytes / worker (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['tp']} | {r['loader']} | error: {r['error'][-200:]!r} |||||")
            continue
        w = r["workers"]

        def mib(key: str, w: list = w) -> str:
            return " / ".join(f"{x[key] / 2**20:.0f}" for x in w)

        rows.append(
            f"| {r['tp']} | {r['loader']} | {r['load_s']:.2f} | {r['first_token_s']:.1f} | "
            f"{mib('peak_rss')} | {mib('private')} | {mib('rchar')} | {mib('read_bytes')} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir")
    ap.add_argument("--target")
    ap.add_argument("--loader", default="weightd")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--layers", type=int, default=10, help="decoder layers (10: 1.14 GB)")
    ap.add_argument("--mem", type=float, default=0.5, help="gpu_memory_utilization")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per engine")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.child:
        args.tp = int(args.tp)
        child(args)
        return
    from bench.ckpt import BENCH_CONFIG, write_checkpoint

    with tempfile.TemporaryDirectory(prefix="weightd-vllm-bench-") as tmp:
        directory = write_checkpoint(
            Path(tmp) / "llama", {**BENCH_CONFIG, "num_hidden_layers": args.layers}
        )
        size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        print(f"checkpoint: {size / 1e9:.2f} GB in {directory}", flush=True)
        sock = Path(tmp) / "run" / "weightd.sock"
        log = open(Path(tmp) / "daemon.log", "w")  # noqa: SIM115 -- lives as long as the daemon
        serve = ["serve", "--listen", f"unix://{sock}", "--model", f"llama={directory}"]
        daemon = subprocess.Popen(
            [sys.executable, "-m", "weightd.server.cli.main", *serve],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, WEIGHTD_CACHE_DIR=str(Path(tmp) / "cache")),
        )
        results = []
        try:
            from tests.health import wait_serving  # pytest-free: .venv-vllm has none

            wait_serving(f"unix://{sock}", daemon, Path(tmp) / "daemon.log", timeout=600)
            for _ in range(args.rounds):
                for tp in [int(x) for x in args.tp.split(",")]:
                    for loader in ("weightd", "auto"):
                        r = run_one(args, directory, f"unix://{sock}", tp, loader)
                        print(json.dumps(r)[:400], flush=True)
                        results.append(r)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            log.close()
            # The daemon's share of weightd's load time: each layout's pack, built on its
            # first request (later workers of that layout map it).
            for line in (Path(tmp) / "daemon.log").read_text().splitlines():
                if "built pack" in line:
                    print(line, flush=True)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
