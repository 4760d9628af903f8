"""Time-to-weights on one host: shared-memory packs vs gRPC vs safetensors, TP=2.

Not a test: prints a table. One process per rank, both ranks at once (as torchrun
would start them), torch.set_num_threads(1) in each, warm page cache. A row's time
is the slower rank's, median of --repeat runs; each process times only the load
(imports and connecting are outside the clock).

    .venv/bin/python bench/shm_vs_grpc.py [--dir DIR] [--repeat 3] [--world-size 2]

Rows:
  shm (pack exists)         fetch(transport="shm"): map the daemon's sealed pack
  shm + touch               the same, then read one byte of every page (faults them in)
  shm copy=True             private tensors copied out of the pack
  shm (builds the pack)     the first fetch of a rank: anchors, fill, seal, verify
  grpc (unix socket)        fetch(transport="grpc"): streamed, digest-checked
  safe_open view            safetensors get_slice, lazy views of the file mapping
                            (SIGBUS if the file is truncated; no digest check)
  safe_open + copy          the same, each slice copied out (best safe local peer)

Then the memory note for rank packs vs windows onto one whole-model region.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
METHODS = ["shm", "shm-touch", "shm-copy", "grpc", "safe_open-view", "safe_open-copy"]


# --- one rank, in its own process --------------------------------------------------------


def _touch(state: dict[str, Any]) -> None:
    import torch

    for t in state.values():  # one byte of every 4 KiB page: every page faulted in
        int(t.reshape(-1).view(torch.uint8)[::4096].sum())


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from ckpt import split_of

    method, rank, ws = args.child, args.rank, args.world_size
    state: dict[str, Any] = {}
    if method.startswith("safe_open"):
        from safetensors import safe_open

        config = json.loads((Path(args.dir) / "config.json").read_text())
        index = json.loads((Path(args.dir) / "model.safetensors.index.json").read_text())
        by_shard: dict[str, list[str]] = {}
        for name, shard in index["weight_map"].items():
            by_shard.setdefault(shard, []).append(name)
        started = time.perf_counter()
        for shard, names in by_shard.items():
            with safe_open(str(Path(args.dir) / shard), framework="pt") as f:
                for name in names:
                    sl = f.get_slice(name)
                    cut = split_of(name, config, ws, rank)
                    if cut is None:
                        t = sl[:]
                    elif cut[0] == 0:
                        t = sl[cut[1] : cut[2]]
                    else:
                        t = sl[:, cut[1] : cut[2]]
                    state[name] = (
                        t.clone(memory_format=torch.contiguous_format)
                        if (method == "safe_open-copy")
                        else t
                    )
        seconds = time.perf_counter() - started
    else:
        from weightd.client import WeightClient

        client = WeightClient(args.target, timeout=600)
        transport = "grpc" if method == "grpc" else "shm"
        started = time.perf_counter()
        state, info = client.fetch_with_info(
            rank, ws, transport=transport, copy=method == "shm-copy"
        )
        if method == "shm-touch":
            _touch(state)
        seconds = time.perf_counter() - started
        assert info.transport == transport, info
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"seconds": seconds, "bytes": nbytes}))


# --- the driver -------------------------------------------------------------------------


def run_ranks(method: str, args: argparse.Namespace, target: str) -> tuple[float, int]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                method,
                "--rank",
                str(rank),
                "--world-size",
                str(args.world_size),
                "--target",
                target,
                "--dir",
                str(args.dir),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(args.world_size)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode:
            raise SystemExit(f"{method} rank failed ({p.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return max(r["seconds"] for r in results), results[0]["bytes"]


def start_daemon(
    args: argparse.Namespace, sock: Path, extra: tuple[str, ...] | list[str] = ()
) -> subprocess.Popen[bytes]:
    log = open(sock.parent / "daemon.log", "wb")  # noqa: SIM115 - lives with the daemon
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightd.server.cli.main",
            "serve",
            "--listen",
            f"unix://{sock}",
            "--model",
            f"bench={args.dir}",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    from weightd.client import WeightClient

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            raise SystemExit(f"daemon exited: see {sock.parent / 'daemon.log'}")
        try:
            with WeightClient(f"unix://{sock}", timeout=2) as c:
                if c.list_models()[0].ready:
                    return daemon
        except Exception:
            pass
        time.sleep(0.2)
    raise SystemExit("daemon not ready after 300 s")


def layout_note(directory: Path, world_size: int) -> None:
    """Rank packs vs windows onto one whole-model region: bytes, and the copy time."""
    from weightd.server.packs.build import layout_pack
    from weightd.server.registry.models import load_model

    model = load_model(str(directory))
    try:
        total = model.checkpoint.total_bytes
        packs = contiguous = strided = 0
        for rank in range(world_size):
            plan = model.plan(world_size, rank)
            packs += layout_pack(plan.slices)[1]
            for s in plan.slices:
                if s.pattern.count == 1:
                    contiguous += s.nbytes
                else:
                    strided += s.nbytes
        fd = os.memfd_create("bench-whole-model")
        os.ftruncate(fd, total)
        os.posix_fallocate(fd, 0, total)
        import mmap

        region = mmap.mmap(fd, total)
        started = time.perf_counter()
        with memoryview(region) as view:
            pos = 0
            for t in model.checkpoint.tensors.values():
                model.store.read_into(t.shard, t.offset, view[pos : pos + t.nbytes])
                pos += t.nbytes
        whole_seconds = time.perf_counter() - started
        region.close()
        os.close(fd)
    finally:
        model.store.close()
    mb = 1e6
    print(f"\nRank packs vs windows onto one whole-model region (TP={world_size}):")
    print(f"  model payload                               {total / mb:8.1f} MB")
    print(f"  rank slices, contiguous (dim-0 / replicated) {contiguous / mb:8.1f} MB")
    print(f"  rank slices, strided (row-parallel)          {strided / mb:8.1f} MB")
    print(f"  per-rank packs, all ranks                    {packs / mb:8.1f} MB")
    print(f"  whole region + strided copies                {(total + strided) / mb:8.1f} MB")
    print(f"  copying the whole model into a memfd         {whole_seconds:8.3f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "weightd-bench-526M")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(HERE))
    from ckpt import write_checkpoint

    write_checkpoint(args.dir)
    for f in args.dir.iterdir():  # warm the page cache
        f.read_bytes()
    with tempfile.TemporaryDirectory(prefix="weightd-bench-") as tmp:
        sock = Path(tmp) / "run" / "weightd.sock"
        sock.parent.mkdir(mode=0o700)
        daemon = start_daemon(args, sock)
        target = f"unix://{sock}"
        try:
            build, nbytes = run_ranks("shm", args, target)  # the first fetch builds the packs
            rows: dict[str, list[float]] = {m: [] for m in METHODS}
            for _ in range(args.repeat):
                for m in METHODS:
                    rows[m].append(run_ranks(m, args, target)[0])
        finally:
            daemon.terminate()
            daemon.wait(60)
    best = {m: statistics.median(v) for m, v in rows.items()}
    ref = best["safe_open-copy"]
    print(
        f"\nTime to weights, TP={args.world_size}, {nbytes / 1e6:.0f} MB per rank, "
        f"median of {args.repeat} (slower rank), warm page cache:"
    )
    print(f"  {'method':<28}{'seconds':>10}{'vs safe_open+copy':>20}{'GB/s/rank':>12}")
    labels = {
        "shm": "shm (pack exists)",
        "shm-touch": "shm + touch every page",
        "shm-copy": "shm copy=True",
        "grpc": "grpc (unix socket)",
        "safe_open-view": "safe_open view (no copy)",
        "safe_open-copy": "safe_open + copy",
    }
    for m in METHODS:
        s = best[m]
        print(f"  {labels[m]:<28}{s:>10.4f}{ref / s:>19.1f}x{nbytes / s / 1e9:>12.2f}")
    print(f"  {'shm (builds the packs)':<28}{build:>10.4f}{ref / build:>19.1f}x")
    layout_note(args.dir, args.world_size)


if __name__ == "__main__":
    main()
