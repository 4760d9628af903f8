"""Building a layout's rank packs, as at a daemon's start and at a publish, against ceilings.

    .venv/bin/python bench/pack_build.py [--layers 10] [--rounds 3] [--only tp1,tp1-before]

In one process, alternating, on a generated checkpoint (10 layers: 1.14 GB):

* ``ceiling``: the payload copied from the page cache (``preadv``) into memory that
  already exists (a buffer written once before): what a build could reach if fresh
  memory cost nothing. No hashing.
* ``floor``: a fresh memfd of the payload's size allocated the old way (collapsed into
  huge pages first on a host at ``never``), filled with ``preadv``: no hashing.
* ``tp1-before`` / ``tp2-before``: ``build_layout_packs`` collapsing into huge pages
  before the fill (``collapse_later=False``: the build before issue 45).
* ``tp1`` / ``tp2``: ``build_layout_packs`` as the daemon now builds (packs published in
  4 KiB pages, collapsed after, in the background); ``huge after`` is how long until
  that upgrade ended, measured after the build's own time (not part of it).
* ``tp1-spare`` / ``tp2-spare``: the same build into spare memory prepared before it
  (``local.spare_pack_bytes``: allocated and collapsed while the daemon was idle; the
  preparation is not timed, it is what the daemon does between publishes).

Every build keeps every check (each tensor's BLAKE3 against its verified digest, each
slice's digest, sealing). vLLM's vocab_pad 64 at TP=2. Each row is measured twice:
``start`` with the shard pages dropped first (a daemon's start: the previous daemon
dropped them, its packs were the one copy) and ``publish`` with them in the page
cache (a publish verified them just before). GB/s of payload; the CPU seconds the
build's process spent (every thread, kernel included: on a loaded host the figure
that says what the build costs, whatever else runs); the load average.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="reuse this checkpoint directory (written when absent)")
    ap.add_argument("--only", help="comma-separated cases (default: all)")
    args = ap.parse_args()

    import tempfile

    from bench.ckpt import BENCH_CONFIG, write_checkpoint
    from weightd.common.hugemap import map_aligned
    from weightd.server.packs import layoutbuild
    from weightd.server.packs.build import layout_pack
    from weightd.server.packs.hugepages import allocate, shmem_mode
    from weightd.server.packs.spare import SparePool
    from weightd.server.plan.layout import Layout
    from weightd.server.registry.models import load_model

    with tempfile.TemporaryDirectory(prefix="weightd-pack-build-") as tmp:
        where = Path(args.dir) if args.dir else Path(tmp) / "llama"
        directory = write_checkpoint(where, {**BENCH_CONFIG, "num_hidden_layers": args.layers})
        model = load_model(str(directory))
        payload = model.checkpoint.total_bytes
        shards = sorted(directory.glob("*.safetensors"))
        size = sum(p.stat().st_size for p in shards)
        warm_buffer = mmap.mmap(-1, size)
        warm_buffer.write(b"\1" * size)  # every page exists before the ceiling is measured
        extra = {"huge after": 0.0}
        load = {"before": 0.0}
        started = {"at": 0.0, "cpu": 0.0}

        def cpu_now() -> float:  # every thread of this process, kernel time included
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime

        def fill(view: memoryview) -> None:
            pos = 0
            for p in shards:
                with open(p, "rb") as f:
                    n = os.path.getsize(p)
                    got = 0
                    while got < n:
                        got += os.preadv(f.fileno(), [view[pos + got : pos + n]], got)
                    pos += n

        def ceiling() -> None:
            with memoryview(warm_buffer) as view:
                fill(view)

        def floor() -> None:
            fd = os.memfd_create("floor", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                writer = map_aligned(fd, size, shared=True)
                allocate(writer, fd, size, shmem_mode(), os.cpu_count() or 1)
                with memoryview(writer).cast("B") as view:
                    fill(view)
                del writer
            finally:
                os.close(fd)

        class Prepared(SparePool):
            """Spares prepared by the bench before the timed build, none after it."""

            def prepare_in_background(self, sizes: Sequence[int]) -> None:
                return None

        def build(
            tp: int, pad: int, later: bool, spare: bool = False
        ) -> Callable[[], Callable[[], None]]:
            plans = [
                model.plan_layout(Layout(tp_size=tp, tp_rank=r, vocab_pad=pad)) for r in range(tp)
            ]
            pool = Prepared(1 << 40) if spare else None

            def run() -> Callable[[], None]:
                packs = layoutbuild.build_rank_packs(
                    model.store,
                    model.checkpoint.tensors,
                    model.tensor_digests,
                    plans,
                    [f"b{r}" for r in range(tp)],
                    collapse_later=later,
                    spares=pool,
                )

                def after() -> None:  # outside the build's time: the background upgrade
                    started = time.perf_counter()
                    for p in packs:
                        p.settled.wait()
                    extra["huge after"] = time.perf_counter() - started
                    for p in packs:
                        p.close()

                return after

            if pool is None:
                return run

            def with_spares() -> Callable[[], None]:
                pool.prepare([layout_pack(p.slices)[1] for p in plans], os.cpu_count() or 1)
                load["before"] = os.getloadavg()[0]
                started["at"] = time.perf_counter()  # the build's time starts here
                started["cpu"] = cpu_now()
                return run()

            return with_spares

        def plain(f: Callable[[], None]) -> Callable[[], Callable[[], None]]:
            def run() -> Callable[[], None]:
                f()
                return lambda: None

            return run

        def drop() -> None:
            for p in shards:
                with open(p, "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

        def warm() -> None:
            for p in shards:
                with open(p, "rb") as f:
                    while f.read(16 << 20):
                        pass

        cases = {
            "ceiling": plain(ceiling),
            "floor": plain(floor),
            "tp1-before": build(1, 0, False),
            "tp1": build(1, 0, True),
            "tp2-before": build(2, 64, False),
            "tp2": build(2, 64, True),
            "tp1-spare": build(1, 0, True, True),
            "tp2-spare": build(2, 64, True, True),
        }
        if args.only:
            cases = {k: v for k, v in cases.items() if k in args.only.split(",")}
        print(
            f"payload {payload / 1e9:.2f} GB, shmem_enabled={shmem_mode()}, {os.cpu_count()} cores"
        )
        print(
            "| round | as at | case | seconds | GB/s | CPU s | GB per CPU s | huge after (s) "
            "| load avg |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in range(args.rounds):
            for when, prepare in (("start", drop), ("publish", warm)):
                for name, run in cases.items():
                    prepare()
                    extra["huge after"] = 0.0
                    load["before"] = os.getloadavg()[0]
                    started["at"] = time.perf_counter()
                    started["cpu"] = cpu_now()
                    after = run()
                    seconds = time.perf_counter() - started["at"]
                    cpu = cpu_now() - started["cpu"]
                    after()
                    print(
                        f"| {r} | {when} | {name} | {seconds:.2f} | {payload / seconds / 1e9:.2f}"
                        f" | {cpu:.2f} | {payload / cpu / 1e9:.2f} | {extra['huge after']:.2f}"
                        f" | {load['before']:.1f} |",
                        flush=True,
                    )
        warm_buffer.close()
        model.store.close()


if __name__ == "__main__":
    main()
