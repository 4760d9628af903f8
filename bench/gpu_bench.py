"""A short GPU benchmark: time-to-weights on cuda:0 per transport, and pinned H2D speed.

Not a test; part of ``tests/gpu/run_all.sh`` (under 3 minutes on one GPU). **Never
run yet**: written without a GPU. Uses the ~526 MB checkpoint of bench/ckpt.py, one
rank of TP=2, in a fresh process per measurement (so CUDA IPC handles are opened
anew), against a daemon started with --cuda-ipc --pin.

    python bench/gpu_bench.py [--dir DIR] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
METHODS = ["cuda_ipc", "cuda_ipc-copy", "shm-to-cuda", "grpc-to-cuda"]


def child(args: argparse.Namespace) -> None:
    import torch

    from weightd.client import WeightClient

    torch.set_num_threads(1)
    torch.cuda.init()
    torch.empty(1, device="cuda:0")  # CUDA context outside the clock, as in a real engine
    client = WeightClient(args.target, timeout=600)
    transport = {"cuda_ipc": "cuda_ipc", "cuda_ipc-copy": "cuda_ipc", "shm-to-cuda": "shm"}.get(
        args.child, "grpc"
    )
    torch.cuda.synchronize()
    started = time.perf_counter()
    state, info = client.fetch_with_info(
        0, 2, device="cuda:0", transport=transport, copy=args.child == "cuda_ipc-copy"
    )
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    assert info.transport == transport, info
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"seconds": seconds, "bytes": nbytes}))


def run(method: str, target: str) -> tuple[float, int]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", method, "--target", target],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return float(r["seconds"]), int(r["bytes"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "weightd-bench-526M")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(HERE))
    from ckpt import write_checkpoint
    from shm_vs_grpc import start_daemon

    write_checkpoint(args.dir)
    with tempfile.TemporaryDirectory(prefix="weightd-gpubench-") as tmp:
        sock = Path(tmp) / "run" / "weightd.sock"
        sock.parent.mkdir(mode=0o700)
        daemon = start_daemon(args, sock, ["--cuda-ipc", "--pin"])
        target = f"unix://{sock}"
        try:
            first, nbytes = run("cuda_ipc", target)  # builds the host pack and the GPU pack
            rows = {m: [run(m, target)[0] for _ in range(args.repeat)] for m in METHODS}
        finally:
            daemon.terminate()
            daemon.wait(60)
        log = (sock.parent / "daemon.log").read_text()
    print(f"\nTime to weights on cuda:0, rank 0 of TP=2 ({nbytes / 1e6:.0f} MB), median:")
    for m in METHODS:
        s = statistics.median(rows[m])
        print(f"  {m:<16}{s:>10.4f} s{nbytes / s / 1e9:>10.2f} GB/s")
    print(f"  {'first cuda_ipc':<16}{first:>10.4f} s   (builds host pack, pins, places on GPU)")
    print("\nDaemon placements (H2D from the pinned pack):")
    for line in log.splitlines():
        if "placed pack" in line:
            print("  " + line.split(": ", 1)[-1])


if __name__ == "__main__":
    main()
