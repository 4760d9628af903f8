"""vLLM's engine start from weightd against vLLM's own loaders, one invocation, alternating.

    .venv-vllm/bin/python bench/vllm_load.py [--tp 1,2] [--layers 10] [--json out.json]

Writes a deterministic random Llama-style checkpoint with GQA (TinyLlama widths, 32
query / 4 kv heads, bf16; 10 layers: 1.14 GB) into a temporary directory (never a
download, never committed). For each TP size:

1. ``weightd serve`` is (re)started with the layouts vLLM will ask for declared
   (``--layout tp=1``, ``--layout tp=2,vocab_pad=64``), warm page cache and hash cache:
   the seconds from starting it to SERVING and its ``layouts_built`` event (the packs
   built before SERVING: seconds, GB/s of payload) are recorded;
2. cases, each running every loader in turn (weightd, vLLM's default ``auto``,
   ``runai_streamer``):

   * ``first``: the first engine after that start;
   * ``second``: another engine;
   * ``cold``: ``echo 3 > /proc/sys/vm/drop_caches`` (root) before each engine;

   ``fastsafetensors`` runs once (the first case of the first TP size): its loader
   hard-codes a CUDA device, so on this CPU build its error is what is shown.

   Page cache per loader: a weightd host holds the checkpoint once, in the packs (the
   daemon dropped the shard pages), so before each weightd engine of ``first`` and
   ``second`` the checkpoint's pages are dropped (``POSIX_FADV_DONTNEED``, these files
   only); before each other loader's they are read (warm), as a host running that
   loader would have them.

Per engine: the seconds each worker spent in its loader's ``load_weights`` (timed
around the call in every worker process, whatever the loader: ``sitecustomize`` on the
children's path wraps vLLM's ``BaseModelLoader.load_model``; the max over workers is
reported, with vLLM's own ``Loading weights took`` line where its loader prints one),
``LLM()`` to the first token, and the host memory holding weights while the engine runs:
the checkpoint's pages in the page cache (``mincore``), the daemon's resident packs
(its ``weightd_shm_pack_resident_bytes``) and the workers' private memory
(``smaps_rollup``), with the load average before the engine.
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
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = [1, 306, 4966, 304, 1827]
LOADERS = ("weightd", "auto", "runai_streamer")
DROP_CACHES = "/proc/sys/vm/drop_caches"

#: Put on the engine children's PYTHONPATH: times ``load_weights`` inside every worker.
SITECUSTOMIZE = """
import importlib.abc, importlib.machinery, sys, time

_NAME = "vllm.model_executor.model_loader.base_loader"


def _patch(module):
    base = module.BaseModelLoader
    original = base.load_model

    def load_model(self, *args, **kwargs):
        inner = self.load_weights

        def timed(model, model_config):
            # The model's own load_weights too: vLLM copying the weights it is given
            # into its parameters (for a loader that streams from files, its reads too).
            own = model.load_weights
            spent = [0.0]

            def model_load_weights(weights):
                began = time.perf_counter()
                try:
                    return own(weights)
                finally:
                    spent[0] += time.perf_counter() - began

            model.load_weights = model_load_weights
            started = time.perf_counter()
            try:
                return inner(model, model_config)
            finally:
                del model.load_weights
                print(f"BENCH load_weights {time.perf_counter() - started:.4f}", flush=True)
                print(f"BENCH model.load_weights {spent[0]:.4f}", flush=True)

        self.load_weights = timed
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.load_weights

    base.load_model = load_model


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
"""


def page_cache_bytes(directory: str) -> int:
    """Bytes of the checkpoint's shards in the page cache (``mincore``)."""
    from weightd.server.store.residency import resident_bytes

    total = 0
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                total += resident_bytes(fd)[1]
            finally:
                os.close(fd)
    return total


def shm_bytes(metrics_url: str) -> int:
    """The daemon's resident pack bytes (all models), from its metrics."""
    if not metrics_url:
        return 0
    with urllib.request.urlopen(metrics_url, timeout=30) as reply:  # loopback only
        text = reply.read().decode()
    found = re.findall(r"^weightd_shm_pack_resident_bytes\{[^}]*\} (\S+)$", text, re.M)
    return int(sum(float(x) for x in found))


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
    report = getattr(worker.model_runner.model, "weightd_load_report", None)
    out["weightd_bytes"] = report.bytes if report is not None else 0
    out["pack_built"] = int(bool(report and report.pack_built))
    if report is not None:  # seconds per step inside the loader (LoadReport.steps)
        out["steps"] = dict(getattr(report, "steps", {}))
        out["described_over"] = getattr(report, "described_over", "")
    return out


def child(args: argparse.Namespace) -> None:
    """One engine: print a JSON line with its timings, per-worker figures, host memory."""
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
    result = {
        "first_token_s": first_token,
        "workers": stats,
        "token": out[0].outputs[0].token_ids,
        "page_cache": page_cache_bytes(args.dir),
        "shm": shm_bytes(args.metrics),
    }
    print("RESULT " + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


def run_one(args: argparse.Namespace, env: dict[str, str], tp: int, loader: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        *("--dir", args.dir, "--target", args.target, "--tp", str(tp)),
        *("--loader", loader, "--mem", str(args.mem), "--metrics", args.metrics),
    ]
    load = os.getloadavg()[0]
    try:
        proc = subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=args.timeout, env=env
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-400:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else str(tail)
        return {
            "tp": tp,
            "loader": loader,
            "load_avg": load,
            "error": f"timed out after {args.timeout} s; its output ended: {text!r}",
        }
    log = proc.stdout + proc.stderr  # vLLM's workers log to stdout
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        errors = [x for x in log.splitlines() if "Error" in x or "error" in x]
        return {"tp": tp, "loader": loader, "load_avg": load, "error": " | ".join(errors[-3:])}
    result = json.loads(line[len("RESULT ") :])
    timed = [float(x) for x in re.findall(r"BENCH load_weights ([\d.]+)", log)]
    own = [float(x) for x in re.findall(r"Loading weights took ([\d.]+) seconds", log)]
    into = [float(x) for x in re.findall(r"BENCH model.load_weights ([\d.]+)", log)]
    result.update(
        tp=tp,
        loader=loader,
        load_s=max(timed) if timed else None,
        vllm_line_s=max(own) if own else None,
        model_load_weights_s=max(into) if into else None,
        load_avg=load,
    )
    return result


def set_page_cache(directory: str, warm: bool) -> None:
    """Read the checkpoint's shards into the page cache, or drop them (these files only)."""
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            if warm:
                while os.read(fd, 16 << 20):
                    pass
            else:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_all_caches() -> bool:
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError:
        return False
    return True


class Daemon:
    """``weightd serve`` with the layouts declared, on a private socket, metrics on loopback."""

    def __init__(self, tmp: Path, directory: str) -> None:
        self.tmp = tmp
        self.directory = directory
        self.layouts: list[str] = []
        self.sock = tmp / "run" / "weightd.sock"
        self.target = f"unix://{self.sock}"
        self.process: subprocess.Popen[str] | None = None
        self.metrics = ""
        self.starts: list[dict[str, Any]] = []

    def start(self) -> dict[str, Any]:
        from tests.health import wait_serving  # pytest-free: .venv-vllm has none

        log_path = self.tmp / f"daemon-{len(self.starts)}.log"
        args = ["serve", "--listen", self.target, "--model", f"llama={self.directory}"]
        args += ["--metrics-listen", "127.0.0.1:0", "--no-remember-layouts"]
        for layout in self.layouts:
            args += ["--layout", layout]
        started = time.perf_counter()
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "weightd.server.cli.main", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env=dict(os.environ, WEIGHTD_CACHE_DIR=str(self.tmp / "cache")),
            )
        wait_serving(self.target, self.process, log_path, timeout=600, poll=0.02)
        serving = time.perf_counter() - started
        text = log_path.read_text()
        built = re.search(r"layouts_built .*? bytes=(\d+) seconds=([\d.]+)", text)
        verified = re.search(r"verified .*? seconds=([\d.]+)", text)
        found = re.search(r"listening listener=metrics address=(\S+)", text)
        self.metrics = found.group(1) if found else ""
        info = {
            "serving_s": serving,
            "verify_s": float(verified.group(1)) if verified else None,
            "build_s": float(built.group(2)) if built else None,
            "build_bytes": int(built.group(1)) if built else 0,
            "load_avg": os.getloadavg()[0],
        }
        self.starts.append(info)
        return info

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(60)
        self.process = None


def table(results: list[dict], payload: int) -> str:
    by_case: dict[tuple[int, str], float] = {}
    for r in results:
        if r.get("loader") == "auto" and r.get("load_s"):
            by_case[(r["tp"], r["case"])] = r["load_s"]
    rows = [
        "| TP | case | loader | weights loaded (s) | vs default | of which model.load_weights "
        "(s) | vLLM's line (s) | LLM() to 1st token (s) | page cache (GB) | packs (GB) | "
        "workers private (GB) | weights in host memory / payload | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        head = f"| {r['tp']} | {r['case']} | {r['loader']} "
        if "error" in r:
            rows.append(head + f"| error: {r['error'][-160:]} ||||||||||")
            continue
        base = by_case.get((r["tp"], r["case"]))
        ratio = f"{r['load_s'] / base:.2f}x" if base and r["load_s"] else ""
        private = sum(w["private"] for w in r["workers"])
        # A host running another loader has no daemon: its copy is the page cache alone
        # (the packs column is the bench's daemon, idle meanwhile).
        shm = r["shm"] if r["loader"] == "weightd" else 0
        held = (r["page_cache"] + shm) / payload
        own = f"{r['vllm_line_s']:.2f}" if r["vllm_line_s"] is not None else ""
        inner = r.get("model_load_weights_s")
        into = f"{inner:.2f}" if inner is not None else ""
        rows.append(
            head + f"| {r['load_s']:.2f} | {ratio} | {into} | {own} | {r['first_token_s']:.1f} | "
            f"{r['page_cache'] / 1e9:.2f} | {shm / 1e9:.2f} | {private / 1e9:.2f} | "
            f"{held:.2f} | {r['load_avg']:.1f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir")
    ap.add_argument("--target")
    ap.add_argument("--metrics", default="")
    ap.add_argument("--loader", default="weightd")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--layers", type=int, default=10, help="decoder layers (10: 1.14 GB)")
    ap.add_argument("--mem", type=float, default=0.5, help="gpu_memory_utilization")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per engine")
    ap.add_argument("--cases", default="first,second,cold")
    ap.add_argument(
        "--loaders",
        default=",".join(LOADERS),
        help="loaders to compare, in this order (a short run: weightd,auto)",
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.child:
        args.tp = int(args.tp)
        child(args)
        return
    from bench.ckpt import BENCH_CONFIG, write_checkpoint

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    tps = [int(x) for x in args.tp.split(",")]
    # What vLLM asks for: vocab_pad 64 above TP=1. One layout declared per start, so the
    # host holds one copy (a host serving both would hold one per layout).
    layouts = {1: "tp=1", 2: "tp=2,vocab_pad=64"}
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="weightd-vllm-bench-") as tmp_name:
        tmp = Path(tmp_name)
        directory = write_checkpoint(
            tmp / "llama", {**BENCH_CONFIG, "num_hidden_layers": args.layers}
        )
        payload = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        print(f"checkpoint: {payload / 1e9:.2f} GB in {directory}", flush=True)
        hook = tmp / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
        path = os.pathsep.join(x for x in (str(hook), os.environ.get("PYTHONPATH", "")) if x)
        env = dict(os.environ, PYTHONPATH=path)
        daemon = Daemon(tmp, str(directory))
        args.dir = str(directory)
        try:
            set_page_cache(str(directory), warm=True)
            cold = daemon.start()  # fills the hash cache: later starts find it warm
            print(f"first start (cold hash cache): {json.dumps(cold)}", flush=True)
            for tp in tps:
                daemon.stop()
                daemon.layouts = [layouts[tp]]
                set_page_cache(str(directory), warm=True)  # warm page cache and hash cache
                info = daemon.start()
                info["tp"] = tp
                print(f"TP={tp}: weightd serve -> SERVING {json.dumps(info)}", flush=True)
                args.target, args.metrics = daemon.target, daemon.metrics
                for case in args.cases.split(","):
                    # fastsafetensors once: it hard-codes a CUDA device (see VLLM.md).
                    once = case == "first" and tp == tps[0]
                    chosen = args.loaders.split(",")
                    once = once and chosen == list(LOADERS)
                    loaders = chosen + (["fastsafetensors"] if once else [])
                    for loader in loaders:
                        if case == "cold":
                            dropped = drop_all_caches()
                        else:
                            set_page_cache(str(directory), warm=loader != "weightd")
                            dropped = None
                        r = run_one(args, env, tp, loader)
                        r.update(case=case, drop_caches=dropped)
                        print(
                            json.dumps({k: v for k, v in r.items() if k != "workers"}), flush=True
                        )
                        results.append(r)
        finally:
            daemon.stop()
    ended = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"\nrun {started} .. {ended}, payload {payload / 1e9:.2f} GB")
    for info in daemon.starts[1:]:
        tp = info["tp"]
        gbps = info["build_bytes"] / info["build_s"] / 1e9 if info["build_s"] else 0.0
        print(
            f"TP={tp} start: weightd serve -> SERVING {info['serving_s']:.2f} s "
            f"(verify {info['verify_s']} s; declared layouts built {info['build_s']} s, "
            f"{gbps:.2f} GB/s of packs; load avg {info['load_avg']:.1f})"
        )
    print(table(results, payload))
    for r in results:
        for rank, w in enumerate(r.get("workers", [])):
            if w.get("steps"):
                steps = ", ".join(f"{k} {v:.3f}" for k, v in w["steps"].items())
                print(
                    f"TP={r['tp']} {r['case']} rank {rank}: described over "
                    f"{w.get('described_over') or '?'}; {steps} s"
                )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"results": results, "starts": daemon.starts, "payload": payload}, indent=1)
        )


if __name__ == "__main__":
    main()
