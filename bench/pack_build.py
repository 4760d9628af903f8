"""Building a layout's rank packs against the floor: filling fresh shared memory.

    .venv/bin/python bench/pack_build.py [--layers 10] [--rounds 3]

In one process, alternating, on a generated checkpoint (10 layers: 1.14 GB) with a
warm page cache:

* ``floor``: a memfd of the payload's size allocated the way packs are (huge pages
  where the kernel gives them, collapsed on a host at ``never``) and filled with
  ``preadv`` from the shard files: no hashing, no cutting. What any pack build pays.
* ``tp1`` / ``tp2``: ``build_layout_packs`` for every rank of the layout (vLLM's
  vocab_pad 64 at TP=2), every check kept: each tensor's BLAKE3 against its verified
  digest, each slice's digest, sealing.

GB/s of payload, the seconds spent allocating (``allocate``: the hypervisor's first
touch of memory this VM never used is paid there), and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="reuse this checkpoint directory (written when absent)")
    args = ap.parse_args()

    import tempfile

    from bench.ckpt import BENCH_CONFIG, write_checkpoint
    from weightd.common.hugemap import map_aligned
    from weightd.server.packs import layoutbuild
    from weightd.server.packs.hugepages import shmem_mode
    from weightd.server.plan.layout import Layout
    from weightd.server.registry.models import load_model

    with tempfile.TemporaryDirectory(prefix="weightd-pack-build-") as tmp:
        where = Path(args.dir) if args.dir else Path(tmp) / "llama"
        directory = write_checkpoint(where, {**BENCH_CONFIG, "num_hidden_layers": args.layers})
        model = load_model(str(directory))
        payload = model.checkpoint.total_bytes
        shards = sorted(directory.glob("*.safetensors"))
        spent = {"allocate": 0.0}
        real = layoutbuild.allocate

        def timed(*a: object, **k: object) -> bool:
            started = time.perf_counter()
            try:
                return real(*a, **k)  # type: ignore[arg-type]
            finally:
                spent["allocate"] += time.perf_counter() - started

        layoutbuild.allocate = timed  # type: ignore[assignment]

        def floor() -> None:
            size = sum(p.stat().st_size for p in shards)
            fd = os.memfd_create("floor", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                writer = map_aligned(fd, size, shared=True)
                timed(writer, fd, size, shmem_mode(), os.cpu_count() or 1)
                view = memoryview(writer).cast("B")
                pos = 0
                for p in shards:
                    with open(p, "rb") as f:
                        n = os.path.getsize(p)
                        got = 0
                        while got < n:
                            got += os.preadv(f.fileno(), [view[pos + got : pos + n]], got)
                        pos += n
                view.release()
                del writer
            finally:
                os.close(fd)

        def build(tp: int, pad: int) -> None:
            plans = [
                model.plan_layout(Layout(tp_size=tp, tp_rank=r, vocab_pad=pad)) for r in range(tp)
            ]
            packs = layoutbuild.build_layout_packs(model, plans, [f"b{r}" for r in range(tp)])
            for p in packs:
                p.close()

        for p in shards:  # warm page cache
            with open(p, "rb") as f:
                while f.read(16 << 20):
                    pass
        cases = {"floor": floor, "tp1": lambda: build(1, 0), "tp2": lambda: build(2, 64)}
        print(
            f"payload {payload / 1e9:.2f} GB, shmem_enabled={shmem_mode()}, {os.cpu_count()} cores"
        )
        print("| round | case | seconds | GB/s | allocate (s) | load avg |")
        print("|---|---|---|---|---|---|")
        for r in range(args.rounds):
            for name, run in cases.items():
                spent["allocate"] = 0.0
                load = os.getloadavg()[0]
                started = time.perf_counter()
                run()
                seconds = time.perf_counter() - started
                print(
                    f"| {r} | {name} | {seconds:.2f} | {payload / seconds / 1e9:.2f} | "
                    f"{spent['allocate']:.2f} | {load:.1f} |",
                    flush=True,
                )
        model.store.close()


if __name__ == "__main__":
    main()
