"""A fresh worker's first same-host fetch: torch already imported, everything else timed.

    .venv/bin/python bench/fresh_fetch.py [--runs 15] [--layers 3] [--tp 2]

Serves a generated checkpoint with the layout declared (so the pack exists), then
starts ``--runs`` fresh worker processes one after another. Each imports torch first
(a worker has it already), then times ``from weightd.client import WeightClient``
and ``WeightClient(target).fetch(rank, tp)`` (shared memory), and lists the gRPC /
protobuf modules loaded by then. Prints the median and minimum of the total and of
each part, and the load average. Bytecode is compiled first (``compileall``): an
installed package has it; a checkout run with ``PYTHONDONTWRITEBYTECODE`` would
otherwise compile every module on every start.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKER = """
import json, sys, time
import torch  # a worker has torch already
t0 = time.perf_counter()
from weightd.client import WeightClient
t1 = time.perf_counter()
client = WeightClient(sys.argv[1])
state = client.fetch(int(sys.argv[2]), int(sys.argv[3]))
t2 = time.perf_counter()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("grpc", "google"))
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "fetch_ms": (t2 - t1) * 1e3,
                  "total_ms": (t2 - t0) * 1e3, "transport": client.last_fetch.transport,
                  "tensors": len(state), "grpc_or_protobuf_modules": len(loaded)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    from bench.ckpt import BENCH_CONFIG, write_checkpoint
    from tests.health import wait_serving

    for package in ("client", "server"):
        compileall.compile_dir(str(ROOT / package), quiet=1)
    with tempfile.TemporaryDirectory(prefix="weightd-fresh-") as tmp_name:
        tmp = Path(tmp_name)
        directory = write_checkpoint(
            tmp / "llama", {**BENCH_CONFIG, "num_hidden_layers": args.layers}
        )
        sock = tmp / "run" / "weightd.sock"
        target = f"unix://{sock}"
        log_path = tmp / "daemon.log"
        serve = ["serve", "--listen", target, "--model", f"llama={directory}"]
        serve += ["--layout", f"tp={args.tp}"]
        with open(log_path, "w") as log:
            daemon = subprocess.Popen(
                [sys.executable, "-m", "weightd.server.cli.main", *serve],
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                env=dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp / "cache")),
            )
        runs = []
        try:
            wait_serving(target, daemon, log_path, timeout=600)
            load = os.getloadavg()[0]
            for i in range(args.runs):
                done = subprocess.run(
                    [sys.executable, "-c", WORKER, target, str(i % args.tp), str(args.tp)],
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=True,
                )
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                time.sleep(0.05)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
    print(json.dumps(runs[0]))
    for key in ("import_ms", "fetch_ms", "total_ms"):
        values = [r[key] for r in runs]
        print(f"{key}: median {statistics.median(values):.1f}, min {min(values):.1f}")
    print(
        f"transports {sorted({r['transport'] for r in runs})}; gRPC/protobuf modules "
        f"loaded: {max(r['grpc_or_protobuf_modules'] for r in runs)}; "
        f"load avg {load:.1f} -> {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
