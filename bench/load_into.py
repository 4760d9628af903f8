"""Loading a rank into a model's existing parameters: in place vs fetch-then-copy.

Not a test: prints a table. An inference engine allocates its parameters first and
then fills them. Each row does that for one rank of a generated Llama-style bf16
checkpoint, in a fresh process whose module already holds every parameter at its
final shape with every page touched (allocated outside the clock, as an engine does):

  fetch+copy      ``client.fetch(transport="grpc")`` then ``module.load_state_dict``:
                  the rank arrives in fresh tensors, then torch copies it in.
  load_into       ``client.load_into(module, transport="grpc")``: each slice is
                  received straight into its parameter (``in_place=True``, default).
  load_into-shm   ``client.load_into(module)`` on the daemon's host: the shared pack is
                  mapped and torch copies from it (reference: the same-host path).

Reported per row: median wall time, GB/s, the ratio to fetch+copy, and the peak
memory the load added to the process (``VmHWM`` after minus ``VmRSS`` before, the
high-water mark reset through ``/proc/self/clear_refs``), in MB and as a fraction of
the rank's bytes. Rows alternate inside each repeat. Every run checks the module
ends up holding exactly the rank's bytes (SHA-256 over every parameter).

    .venv/bin/python bench/load_into.py [--size-mb 400] [--world-size 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROWS = ["fetch+copy", "load_into", "load_into-shm"]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def module_for(spec: dict[str, list[Any]]) -> Any:
    """A module with a zero-filled (touched) parameter per name: dtype and shape from ``spec``."""
    import torch

    root = torch.nn.Module()
    for name, (dtype, shape) in spec.items():
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if not hasattr(m, part):
                m.add_module(part, torch.nn.Module())
            m = getattr(m, part)
        t = torch.zeros(shape, dtype=getattr(torch, dtype))
        m.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def state_digest(state: dict[str, Any]) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def child(args: argparse.Namespace) -> None:
    import torch

    from weightd.client import WeightClient

    torch.set_num_threads(1)
    spec = json.loads(Path(args.spec).read_text())
    module = module_for(spec["tensors"])
    client = WeightClient(args.target, timeout=600)
    client.list_models()  # connected before the clock starts
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before_kb = _status_kb("VmRSS")
    started = time.perf_counter()
    if args.child == "fetch+copy":
        state = client.fetch(args.rank, args.world_size, transport="grpc")
        module.load_state_dict(state)
        del state
        transport = "grpc"
    else:
        info = client.load_into(
            module,
            args.rank,
            args.world_size,
            transport="grpc" if args.child == "load_into" else "auto",
        )
        transport = info.transport
    seconds = time.perf_counter() - started
    peak_kb = _status_kb("VmHWM") - before_kb
    ok = state_digest(module.state_dict()) == spec["digest"]
    client.close()
    print(json.dumps({"seconds": seconds, "peak_mb": peak_kb / 1024, "ok": ok, "via": transport}))


def run_child(row: str, target: str, spec: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", row, "--target", target, "--spec", str(spec)]
    cmd += ["--rank", str(args.rank), "--world-size", str(args.world_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode:
        raise SystemExit(f"{row}: child failed\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["ok"]:
        raise SystemExit(f"{row}: the module does not hold the rank's bytes")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sys.path.insert(0, str(ROOT))
    from bench.checkpoint import add_rank_bench_args, warm_rank_checkpoint

    add_rank_bench_args(p)
    p.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    p.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    from bench.run import start_daemon, stop_daemon
    from weightd.client import WeightClient

    directory = warm_rank_checkpoint(args)
    runs: dict[str, list[dict[str, Any]]] = {r: [] for r in ROWS}
    with tempfile.TemporaryDirectory(prefix="weightd-load-bench-") as tmp:
        work = Path(tmp)
        (work / "run").mkdir(mode=0o700)
        daemon = start_daemon(directory, f"unix://{work / 'run' / 'weightd.sock'}", work / "d.log")
        try:
            with WeightClient(daemon.target, timeout=600) as c:
                state = c.fetch(args.rank, args.world_size, transport="grpc")
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            spec = work / "spec.json"
            tensors = {n: [str(t.dtype).split(".")[1], list(t.shape)] for n, t in state.items()}
            spec.write_text(json.dumps({"tensors": tensors, "digest": state_digest(state)}))
            del state
            run_child("load_into-shm", daemon.target, spec, args)  # builds the pack once
            for i in range(args.repeat):
                for row in ROWS if i % 2 == 0 else ROWS[::-1]:
                    runs[row].append(run_child(row, daemon.target, spec, args))
        finally:
            stop_daemon(daemon)
    base = statistics.median(r["seconds"] for r in runs["fetch+copy"])
    print(
        f"\nLoading rank {args.rank} of TP={args.world_size} ({nbytes / 1e6:.0f} MB, "
        f"{len(tensors)} tensors) into a module's existing parameters; median of {args.repeat}:"
    )
    head = ("row", "via", "seconds", "GB/s", "vs copy", "peak MB", "x rank")
    print("  {:<15}{:>6}{:>10}{:>8}{:>9}{:>10}{:>8}".format(*head))
    for row in ROWS:
        s = statistics.median(r["seconds"] for r in runs[row])
        peak = statistics.median(r["peak_mb"] for r in runs[row])
        print(
            f"  {row:<15}{runs[row][0]['via']:>6}{s:>10.3f}{nbytes / s / 1e9:>8.2f}"
            f"{base / s:>8.2f}x{peak:>10.1f}{peak * 1048576 / nbytes:>8.2f}"
        )
    print("every run's module held exactly the rank's bytes (SHA-256 over every parameter)")


if __name__ == "__main__":
    main()
