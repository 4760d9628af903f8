"""A worker process for the shared-memory tests, driven by JSON lines on stdin.

Each line is a command; each answer is one JSON line on stdout. The worker holds
whatever it fetched until told to drop it, so tests can measure, restart daemons,
damage shard files, or kill it while it holds a lease.

    {"op": "fetch", "target": T, "rank": R, "world_size": N, "transport": "shm", "copy": false,
     "names": null, "device": "cpu", "populate": false}
    {"op": "touch"}        read every byte of every tensor (fault the pages in)
    {"op": "smaps"}        this process's /proc/self/smaps_rollup, in kB
    {"op": "digests"}      SHA-256 of every held tensor's bytes
    {"op": "drop"}         let go of the tensors (ends the lease)
    {"op": "attach", "target": T, "ref": {...PackRef fields...}}
    {"op": "quit"}
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import sys
from typing import Any

import torch

from weightd.client import PackRef, WeightClient, WeightdError


def smaps_rollup() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1])
    return out


def digest(t: torch.Tensor) -> str:
    raw = t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return hashlib.sha256(memoryview(raw)).hexdigest()


def main() -> None:
    torch.set_num_threads(1)
    state: dict[str, torch.Tensor] = {}
    clients: dict[str, WeightClient] = {}
    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        op = cmd["op"]
        reply: dict[str, Any] = {"ok": True}
        try:
            if op in ("fetch", "attach"):
                populate = bool(cmd.get("populate", False))
                key = f"{cmd['target']} populate={populate}"
                if key not in clients:
                    clients[key] = WeightClient(cmd["target"], timeout=60, populate=populate)
                client = clients[key]
                if op == "fetch":
                    state, info = client.fetch_with_info(
                        cmd["rank"],
                        cmd["world_size"],
                        names=cmd.get("names"),
                        device=cmd.get("device", "cpu"),
                        transport=cmd.get("transport", "auto"),
                        copy=cmd.get("copy", False),
                    )
                else:
                    state, info = client.attach(
                        PackRef(**cmd["ref"]), device=cmd.get("device", "cpu")
                    )
                reply["transport"] = info.transport
                reply["pack"] = dataclasses.asdict(info.pack) if info.pack else None
                reply["nbytes"] = sum(t.numel() * t.element_size() for t in state.values())
            elif op == "touch":
                # Hash every byte through a NumPy view: reads all pages, allocates nothing
                # (a torch reduction would make a temporary as big as the tensor).
                reply["digests"] = {n: digest(t) for n, t in state.items()}
            elif op == "smaps":
                reply["smaps"] = smaps_rollup()
            elif op == "digests":
                reply["digests"] = {n: digest(t) for n, t in state.items()}
            elif op == "drop":
                state = {}
                gc.collect()
            elif op == "quit":
                print(json.dumps(reply), flush=True)
                return
            else:
                reply = {"ok": False, "error": f"unknown op {op}"}
        except WeightdError as exc:
            reply = {"ok": False, "error": str(exc), "code": exc.code.name}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
