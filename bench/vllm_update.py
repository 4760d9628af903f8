"""A running vLLM engine moving to a new checkpoint: weightd's update vs vLLM's reload vs a restart.

    .venv-vllm/bin/python bench/vllm_update.py [--rounds 3] [--tp 1,2] [--layers 10]

Writes two deterministic random Llama-style checkpoints of the same shapes (TinyLlama
widths, GQA 32/4, bf16; 10 layers: 1.14 GB each; never downloaded, never committed)
and serves the first with ``weightd serve`` on a private Unix socket. Then, per TP
size, one engine process (``weight_transfer_config={"backend": "weightd"}``, started
from disk on the first checkpoint) alternates, ``--rounds`` times, between:

* **weightd**: the other checkpoint is published (``AdminClient.publish``: verified,
  the packs of the layouts in use prepared; if the daemon already serves it, because
  vLLM's reload moved only the engine, the first checkpoint is published before it,
  untimed, so that it is a new version again), and from the moment the engine's
  ``WatchVersions`` stream says READY, the time until every rank generated a token with
  it: ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` with the
  daemon's version (each rank holds it, fetches and verifies its own share over shared
  memory, all apply in place), then one greedy token;
* **reload**: vLLM's own in-place reload from the other checkpoint's directory
  (``reload_weights(weights_path=...)``, vLLM's layer-wise reload over its default
  safetensors loader: every rank reads what it needs from the files), then one token;

then **weightd, new content**: what a trainer's step is, a checkpoint the daemon never
saw (one tensor changed, the rest hard-linked): its publish hashes it and builds the
packs of the layouts in use before READY (``publish: verify + prepare``), and the
engine updates as above; and last, **restart**: a fresh engine process started on the
other checkpoint, timed from spawning it to its first token (and ``LLM()`` to first
token inside it).

Before the restart, **a trainer's new weights in memory** (issue 45, point 7a), each
round new content, timed from the trainer's call to every rank generating:
``publish_tensors`` from memory (a sealed memfd; no file), the trainer's save of a
directory then ``publish`` and the update, and the trainer's save then vLLM's
``reload_weights`` (``--trainer-rounds``; the load average is read per row).

The first weightd update of each engine finds no pack of its layout (it started from
disk) and waits for the daemon to build it; later publishes prepare them (the
``packs`` column). Each switch's greedy token is checked against the token the same
version gave by the other method, so a method that loaded the wrong bytes would show.
Bytes: what each rank received from the daemon (its share), per update. Load averages
are read before and after each TP size: these machines are shared, read ratios, not
absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPT = [1, 306, 4966, 304, 1827]


def _env(tp: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if tp == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")


def _llm(directory: str, tp: int, mem: float) -> Any:
    from vllm import LLM

    return LLM(
        model=directory,
        tensor_parallel_size=tp,
        gpu_memory_utilization=mem,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        dtype="bfloat16",
        weight_transfer_config={"backend": "weightd"},
    )


def _token(llm: Any) -> int:
    from vllm import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False
    )
    return int(out[0].outputs[0].token_ids[0])


def worker_seconds(worker: Any) -> list[float]:
    """(hold, stage, apply) seconds of this rank's latest update."""
    last = worker.weight_transfer_engine.last
    return [last.hold_seconds, last.stage_seconds, last.apply_seconds]


def worker_bytes(worker: Any) -> int:
    last = getattr(worker.weight_transfer_engine, "last", None)
    return last.share.bytes if last is not None and last.share is not None else 0


def child_switch(args: argparse.Namespace) -> None:
    """One engine: alternate weightd updates and vLLM reloads; print RESULT lines."""
    _env(args.tp)
    from weightd.client import AdminClient, WeightClient
    from weightd.vllm.transfer.rl import update_llm

    dirs = args.dirs.split(",")
    llm = _llm(dirs[0], args.tp, args.mem)
    _token(llm)  # warm
    ready: queue.Queue[tuple[float, int, str]] = queue.Queue()
    client = WeightClient(args.target, timeout=600)
    watch = client.watch_versions("m")

    def follow() -> None:
        for event in watch:
            if event.kind == "ready":
                ready.put((time.perf_counter(), event.info.version, event.info.source))

    threading.Thread(target=follow, daemon=True).start()
    _, current, source = ready.get(timeout=60)  # the current version, announced first
    admin = AdminClient(args.admin, timeout=600)
    real = [os.path.realpath(d) for d in dirs]

    def publish(index: int) -> tuple[Any, float]:
        """Publish ``dirs[index]``; (its reply, when the watch said it is ready)."""
        nonlocal current
        published = admin.publish(dirs[index], model="m")
        if published.version == current:  # the content it serves already: no new version
            return published, time.perf_counter()
        while True:
            t_ready, version, _source = ready.get(timeout=600)
            if version == published.version:
                current = version
                return published, t_ready

    # which checkpoint the engine computes with, and the daemon serves (an earlier TP
    # size's engine may have left it on either)
    engine = 0
    daemon = real.index(os.path.realpath(source)) if os.path.realpath(source) in real else -1
    for round_ in range(args.rounds):
        for method in ("weightd", "reload"):
            target = 1 - engine
            if method == "weightd":
                if daemon == target:  # vLLM's reload moved the engine, not the daemon:
                    publish(1 - target)  # make the target a new version again (not timed)
                t0 = time.perf_counter()
                published, t_ready = publish(target)
                daemon = target
                update_llm(
                    llm, published.version, target=args.target, model="m", verify=args.verify
                )
                token = _token(llm)
                done = time.perf_counter()
                result = {
                    "seconds": done - t_ready,
                    "publish_s": t_ready - t0,
                    "verify_s": published.verify_seconds,
                    "prepare_s": published.prepare_seconds,
                    "packs_built": published.packs_built,
                    "bytes": llm.collective_rpc(worker_bytes),
                    "ranks": llm.collective_rpc(worker_seconds),
                    "weight_version": llm.get_weight_version(),
                }
            else:
                t0 = time.perf_counter()
                llm.collective_rpc(
                    "reload_weights",
                    kwargs={"weights_path": dirs[target], "is_checkpoint_format": True},
                )
                llm.reset_prefix_cache()
                token = _token(llm)
                result = {"seconds": time.perf_counter() - t0}
            engine = target
            result.update(method=method, version_dir=target, token=token, round=round_)
            print("RESULT " + json.dumps(result), flush=True)
    # A trainer's step: content the daemon never saw (one tensor changed), so the
    # publish hashes it and builds the packs of the layouts in use before READY.
    fresh = perturbed_copy(dirs[1 - engine], f"{args.dirs.split(',')[0]}-fresh-tp{args.tp}")
    t0 = time.perf_counter()
    published, t_ready = publish_new(admin, fresh, ready)
    update_llm(llm, published.version, target=args.target, model="m", verify=args.verify)
    _token(llm)
    done = time.perf_counter()
    result = {
        "method": "weightd-fresh",
        "seconds": done - t_ready,
        "publish_s": t_ready - t0,
        "verify_s": published.verify_seconds,
        "prepare_s": published.prepare_seconds,
        "packs_built": published.packs_built,
        "bytes": llm.collective_rpc(worker_bytes),
        "ranks": llm.collective_rpc(worker_seconds),
        "version_dir": -1,
        "token": -1,
    }
    print("RESULT " + json.dumps(result), flush=True)
    trainer_rows(llm, admin, args, dirs[0])
    watch.close()
    llm.llm_engine.engine_core.shutdown()


def trainer_rows(llm: Any, admin: Any, args: argparse.Namespace, base: str) -> None:
    """A trainer's new weights in memory -> every rank generating with them, three ways,
    each round new content (one element changed): **weightd-memory** (``publish_tensors``:
    a sealed memfd, no file), **weightd-directory** (the trainer saves the tensors, then
    ``publish`` + update), **reload-save** (the trainer saves, then vLLM's
    ``reload_weights`` of that directory). The saves are timed: they are the trainer's
    cost of those paths. Saved directories are removed after each row."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from weightd.vllm.transfer.rl import update_llm

    tensors: dict[str, Any] = {}
    for name in sorted(f for f in os.listdir(base) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(base, name)))
    first = sorted(tensors)[0]
    step = 0
    written: list[str] = []
    for round_ in range(args.trainer_rounds):
        for method in ("weightd-memory", "weightd-directory", "reload-save"):
            step += 1
            with torch.no_grad():
                tensors[first].view(-1)[0] = float(step)  # a trainer's next step
            out = f"{base}-step-{args.tp}-{step}"
            t0 = time.perf_counter()
            result: dict[str, Any] = {}
            if method in ("reload-save", "weightd-directory"):
                os.makedirs(out)
                save_file(
                    tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"}
                )
                shutil.copy(os.path.join(base, "config.json"), os.path.join(out, "config.json"))
                result["save_s"] = time.perf_counter() - t0
            if method == "reload-save":
                llm.collective_rpc(
                    "reload_weights", kwargs={"weights_path": out, "is_checkpoint_format": True}
                )
                llm.reset_prefix_cache()
            else:
                if method == "weightd-memory":
                    published = admin.publish_tensors(tensors, model="m", transport="shm")
                else:
                    published = admin.publish(out, model="m")
                result.update(
                    verify_s=published.verify_seconds,
                    prepare_s=published.prepare_seconds,
                    packs_built=published.packs_built,
                    publish_s=time.perf_counter() - t0,
                )
                update_llm(
                    llm, published.version, target=args.target, model="m", verify=args.verify
                )
            _token(llm)
            result.update(
                method=method,
                seconds=time.perf_counter() - t0,
                round=round_,
                version_dir=-1,
                token=-1,
                load=_load(),
            )
            if method != "reload-save":
                result.update(
                    bytes=llm.collective_rpc(worker_bytes), ranks=llm.collective_rpc(worker_seconds)
                )
            written.append(out)
            print("RESULT " + json.dumps(result), flush=True)
    # Removed only now: after vLLM's reload_weights the engine's model is that directory,
    # and the next weightd update compares the served shapes with its config.json.
    for out in written:
        shutil.rmtree(out, ignore_errors=True)


def perturbed_copy(base: str, out: str) -> str:
    """``base`` with one tensor changed (one element negated), everything else hard-linked."""
    import torch
    from safetensors.torch import load_file, save_file

    os.makedirs(out)
    shards = sorted(f for f in os.listdir(base) if f.endswith(".safetensors"))
    for name in os.listdir(base):
        if name != shards[-1]:
            os.link(os.path.join(base, name), os.path.join(out, name))
    tensors = load_file(os.path.join(base, shards[-1]))
    first = sorted(tensors)[0]
    with torch.no_grad():
        flat = tensors[first].view(-1)
        flat[0] = -flat[0] if flat[0] != 0 else 1
    save_file(tensors, os.path.join(out, shards[-1]), metadata={"format": "pt"})
    return out


def publish_new(admin: Any, directory: str, ready: queue.Queue[Any]) -> tuple[Any, float]:
    published = admin.publish(directory, model="m")
    while True:
        t_ready, version, _source = ready.get(timeout=600)
        if version == published.version:
            return published, t_ready


def child_restart(args: argparse.Namespace) -> None:
    _env(args.tp)
    t0 = time.perf_counter()
    llm = _llm(args.dirs.split(",")[0], args.tp, args.mem)
    token = _token(llm)
    print(
        "RESULT " + json.dumps({"llm_to_token_s": time.perf_counter() - t0, "token": token}),
        flush=True,
    )
    llm.llm_engine.engine_core.shutdown()


def _run(cmd: list[str], timeout: float) -> tuple[list[dict[str, Any]], str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    out = [
        json.loads(line[len("RESULT ") :])
        for line in proc.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[2:5]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return out, proc.stdout + proc.stderr


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def bench_tp(
    args: argparse.Namespace, tp: int, dirs: list[Path], target: str, admin: str
) -> dict[str, Any]:
    base = [sys.executable, __file__, "--tp", str(tp), "--mem", str(args.mem)]
    if not args.verify:
        base.append("--no-verify")
    load_before = _load()
    switches, _ = _run(
        [
            *base,
            "--child-switch",
            *("--dirs", ",".join(map(str, dirs)), "--target", target, "--admin", admin),
            *("--rounds", str(args.rounds), "--trainer-rounds", str(args.trainer_rounds)),
        ],
        args.timeout,
    )
    spawned = time.perf_counter()
    restart, _ = _run([*base, "--child-restart", "--dirs", str(dirs[1])], args.timeout)
    restart[0]["seconds"] = time.perf_counter() - spawned
    restart[0]["method"] = "restart"
    restart[0]["version_dir"] = 1
    load_after = _load()
    return {
        "tp": tp,
        "switches": switches,
        "restart": restart[0],
        "load": [load_before, load_after],
    }


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| TP | method | rounds | version ready -> every rank generating (s), median [all] | "
        "bytes received per rank (MiB) | per rank: hold / stage / apply (s), median | "
        "publish: verify + prepare (s), median | load avg before / after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        tokens: dict[int, set[int]] = {}
        for s in [*r["switches"], r["restart"]]:
            if s["version_dir"] >= 0:
                tokens.setdefault(s["version_dir"], set()).add(s["token"])
        agree = all(len(v) == 1 for v in tokens.values())
        for method in ("weightd", "weightd-fresh", "reload"):
            xs = [s for s in r["switches"] if s["method"] == method]
            secs = [s["seconds"] for s in xs]
            every = ", ".join(
                f"{s['seconds']:.2f}"
                + (f" (publish built {s['packs_built']} packs)" if "packs_built" in s else "")
                for s in xs
            )
            mib = "-"
            pub = "-"
            parts = "-"
            if method.startswith("weightd") and xs:
                ranks = len(xs[0]["ranks"])
                parts = " ; ".join(
                    " / ".join(_median([s["ranks"][r][i] for s in xs]) for i in range(3))
                    for r in range(ranks)
                )
                per_rank = [b / 2**20 for b in xs[-1]["bytes"]]
                mib = " / ".join(f"{b:.0f}" for b in per_rank)
                verify = _median([s["verify_s"] for s in xs])
                pub = f"{verify} + {_median([s['prepare_s'] for s in xs])}"
            label = {
                "weightd": "weightd update",
                "weightd-fresh": "weightd update, a trainer's new content (packs prepared)",
                "reload": "vLLM reload_weights (disk)",
            }[method]
            rows.append(
                f"| {r['tp']} | {label} | {len(xs)} | {_median(secs)} [{every}] | {mib} | "
                f"{parts} | {pub} | {r['load'][0]} / {r['load'][1]} |"
            )
        for method, label in (
            ("weightd-memory", "trainer's tensors in memory -> weightd publish_tensors (shm)"),
            ("weightd-directory", "trainer saves a directory -> weightd publish"),
            ("reload-save", "trainer saves a directory -> vLLM reload_weights"),
        ):
            xs = [s for s in r["switches"] if s["method"] == method]
            if not xs:
                continue
            every = ", ".join(
                f"{s['seconds']:.2f}"
                + (f" (save {s['save_s']:.2f})" if "save_s" in s else "")
                + (f" (publish {s['publish_s']:.2f})" if "publish_s" in s else "")
                for s in xs
            )
            pub = (
                f"{_median([s['verify_s'] for s in xs])} + {_median([s['prepare_s'] for s in xs])}"
                if "verify_s" in xs[0]
                else "-"
            )
            loads = "; ".join(s["load"] for s in xs)
            rows.append(
                f"| {r['tp']} | {label} (call -> every rank generating) | {len(xs)} | "
                f"{_median([s['seconds'] for s in xs])} [{every}] | - | - | {pub} | {loads} |"
            )
        rs = r["restart"]
        rows.append(
            f"| {r['tp']} | restart (spawn -> first token; LLM() -> token "
            f"{rs['llm_to_token_s']:.1f}) | 1 | {rs['seconds']:.1f} | - | - | - | "
            f"{r['load'][0]} / {r['load'][1]} |"
        )
        rows.append(f"| {r['tp']} | same token per version by every method | | {agree} ||||")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child-switch", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-restart", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dirs", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--admin", help=argparse.SUPPRESS)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--trainer-rounds",
        type=int,
        default=2,
        help="rounds of the trainer rows (memory, directory, reload with the save)",
    )
    ap.add_argument("--layers", type=int, default=10, help="decoder layers (10: 1.14 GB)")
    ap.add_argument("--mem", type=float, default=0.4, help="gpu_memory_utilization")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per engine process")
    ap.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="updates do not re-hash a shared-memory share (the daemon verified it as it "
        "built the pack); gRPC shares are always checked",
    )
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.child_switch or args.child_restart:
        args.tp = int(args.tp)
        (child_switch if args.child_switch else child_restart)(args)
        return
    from bench.ckpt import BENCH_CONFIG
    from weightd.server.cli.demo import write_llama_checkpoint

    config = {**BENCH_CONFIG, "num_hidden_layers": args.layers}
    with tempfile.TemporaryDirectory(prefix="weightd-vllm-update-") as tmp:
        dirs = []
        for seed in (0, 1):
            d = Path(tmp) / f"v{seed}"
            write_llama_checkpoint(str(d), config, shards=3, seed=seed)
            dirs.append(d)
        size = sum(p.stat().st_size for p in dirs[0].glob("*.safetensors"))
        print(f"checkpoints: 2 x {size / 1e9:.2f} GB in {tmp}", flush=True)
        sock = Path(tmp) / "run" / "weightd.sock"
        log = open(Path(tmp) / "daemon.log", "w")  # noqa: SIM115 -- lives as long as the daemon
        serve = ["serve", "--listen", f"unix://{sock}", "--model", f"m={dirs[0]}"]
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
            admin = f"unix://{sock.parent / 'admin.sock'}"
            for tp in [int(x) for x in args.tp.split(",")]:
                r = bench_tp(args, tp, dirs, f"unix://{sock}", admin)
                print(json.dumps(r)[:2000], flush=True)
                results.append(r)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(60)
            log.close()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
