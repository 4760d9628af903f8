"""One rank process of a benchmark case: wait for "go" on stdin, load, report JSON.

Every loader runs with one torch thread, as torchrun sets it, so no case wins by
oversubscribing the 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.resident import settle

torch.set_num_threads(1)


def _proc_kv(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def memory() -> dict[str, int]:
    smaps = _proc_kv("/proc/self/smaps_rollup")
    status = _proc_kv("/proc/self/status")
    return {
        "rss": smaps.get("Rss", 0),
        "pss": smaps.get("Pss", 0),
        "private": smaps.get("Private_Clean", 0) + smaps.get("Private_Dirty", 0),
        # Anonymous: memory that is this process's own copy (Private_* also counts file
        # pages that only this process happens to map).
        "anon": smaps.get("Anonymous", 0),
        "peak_rss": status.get("VmHWM", 0),
    }


def io() -> dict[str, int]:
    return {k: v for k, v in _proc_kv("/proc/self/io").items() if k in ("rchar", "read_bytes")}


def _part(t: torch.Tensor, split: tuple[int, int, int] | None) -> torch.Tensor:
    if split is None:
        return t.clone()
    dim, a, b = split
    return t.narrow(dim, a, b - a).clone(memory_format=torch.contiguous_format)


def load_peer(case: str, ckpt: Path, rank: int, ws: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from bench.tp import split_of

    config = json.loads((ckpt / "config.json").read_text())
    shards = sorted(ckpt.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if case == "runai-streamer":
        # Run:ai's streamer as its users call it on CPU: one stream_files call for all
        # shards (its concurrent readers fill reused buffers), then slice and keep a copy.
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files([str(s) for s in shards])
            for name, t in streamer.get_tensors():
                out[name] = _part(t, split_of(name, config, ws, rank))
        return out
    if case == "fastsafetensors":
        # fastsafetensors on CPU without GPUDirect: every shard read into its buffers,
        # tensors handed out as views of them; slice and keep a copy.
        from fastsafetensors import fastsafe_open

        paths = [str(s) for s in shards]
        with fastsafe_open(filenames=paths, nogds=True, device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - not a dict
                out[name] = _part(f.get_tensor(name), split_of(name, config, ws, rank))
        return out
    if case in ("read-everything", "lazy-mmap"):
        backend = "pread" if case == "read-everything" else "mmap"
        for shard in shards:
            state = load_file(str(shard), backend=backend)
            for name, t in state.items():
                out[name] = _part(t, split_of(name, config, ws, rank))
            del state
        return out
    if case == "best-local":
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    split = split_of(name, config, ws, rank)
                    if split is None:
                        out[name] = f.get_tensor(name)
                        continue
                    sl = f.get_slice(name)
                    dim, a, b = split
                    out[name] = sl[a:b] if dim == 0 else sl[:, a:b]
        return out
    raise ValueError(case)


def load_weightd(target: str, rank: int, ws: int, transport: str) -> dict[str, torch.Tensor]:
    from weightd.client import WeightClient

    client = WeightClient(target, timeout=600)
    # Shared-memory and CUDA IPC tensors view the daemon's pack; the client's lease
    # lives as long as they do, so the client is not closed here.
    device = "cuda:0" if transport == "cuda_ipc" else "cpu"
    return client.fetch(rank, ws, transport=transport, device=device)  # type: ignore[arg-type]


def state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous().cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--case", required=True)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--target", default="")
    p.add_argument("--transport", default="grpc")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--digest", action="store_true")
    p.add_argument("--until", choices=("resident", "touched"), default="resident")
    args = p.parse_args()
    if args.case.startswith("weightd"):
        # Import before the clock starts, like the peers (safetensors.torch): the client
        # and what a fetch imports lazily -- grpc's channel module (loaded by the first
        # channel; a throwaway one to nowhere connects to nothing) and the transports.
        import grpc

        import weightd.client
        import weightd.client.receive.stream
        import weightd.client.transports.local_fetch
        import weightd.client.transports.shm  # noqa: F401

        grpc.insecure_channel("unix:///nonexistent/weightd-bench.sock").close()
    else:
        import safetensors.torch  # noqa: F401
    before_mem, before_io = memory(), io()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(2)
    started = time.monotonic()
    if args.case.startswith("weightd"):
        state = load_weightd(args.target, args.rank, args.world_size, args.transport)
    else:
        state = load_peer(args.case, args.ckpt, args.rank, args.world_size)
    loaded = time.monotonic()
    settled, proven = settle(state, args.until)
    done = loaded + settled
    # A rank that has its weights waits for the others, as a TP group does at its first
    # collective, before it measures, digests and exits: that work (reading smaps, the
    # interpreter's teardown) would otherwise take the cores from ranks still loading.
    print("done", flush=True)
    if sys.stdin.readline().strip() != "report":
        sys.exit(2)
    released = time.monotonic()
    after_mem, after_io = memory(), io()
    result: dict[str, Any] = {
        "started": started,
        "loaded": loaded,  # the loader returned; the rest until done is the touches
        "done": done,
        "released": released,  # every rank was done: the runner let this one go on
        "until": args.until,
        "proven_resident_bytes": proven,  # shown mapped at "loaded", not touched
        "payload_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "tensors": len(state),
        "mem_before": before_mem,
        "mem_after": after_mem,
        "io": {k: after_io[k] - before_io.get(k, 0) for k in after_io},
    }
    if args.digest:
        result["digest"] = state_digest(state)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
