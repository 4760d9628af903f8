"""Hot-swap latency: LoadAdapter of a ~20 MB LoRA adapter → the event seen by a watching worker.

Not a test: prints a table. Starts ``weightd serve`` in its own process on a private
Unix socket with a generated tiny Llama base and two generated PEFT-format adapters
(random fp32 A/B, ~20 MB each), then replaces the adapter ``--swaps`` times,
alternating the two. Per swap it reports: the LoadAdapter call (read, verify, hash,
publish) and the time from the call's start until a worker's WatchAdapters stream
delivered the replace event; then a worker's FetchAdapter of its TP=2 slice over gRPC,
and the same over shared memory (the first fetch of a version builds its pack).

    .venv/bin/python bench/adapter_swap.py [--swaps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BASE = dict(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_base(directory: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).save_pretrained(directory)


def make_adapter(base: Path, directory: Path, r: int, seed: int) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    weights = {}
    for shard in base.glob("*.safetensors"):
        weights.update(load_file(str(shard)))
    tensors = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in TARGETS:
            continue
        out, inn = w.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, inn) * 0.01
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, r) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 2 * r,
        "target_modules": TARGETS,
        "base_model_name_or_path": str(base),
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return (directory / "adapter_model.safetensors").stat().st_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--swaps", type=int, default=20)
    p.add_argument("--rank", type=int, default=128, help="LoRA r (128: ~20 MB adapters)")
    args = p.parse_args()
    from weightd.client import WeightClient
    from weightd.client.api.admin import AdminClient

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        make_base(tmp / "base")
        sizes = [
            make_adapter(tmp / "base", tmp / "adapters" / n, args.rank, i)
            for i, n in enumerate(("one", "two"))
        ]
        run = tmp / "run"
        sock = run / "weightd.sock"
        cmd = [
            sys.executable,
            "-m",
            "weightd.server.cli.main",
            "serve",
            "--listen",
            f"unix://{sock}",
        ]
        cmd += ["--model", f"base={tmp / 'base'}", "--adapter-root", str(tmp / "adapters")]
        log = open(tmp / "daemon.log", "w")  # noqa: SIM115 - closed below
        daemon = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            while not (run / "admin.sock").exists():
                if daemon.poll() is not None:
                    sys.exit((tmp / "daemon.log").read_text())
                time.sleep(0.05)
            client = WeightClient(f"unix://{sock}", timeout=120)
            admin = AdminClient(f"unix://{run / 'admin.sock'}", timeout=120)
            while not all(m.ready for m in client.list_models()):
                time.sleep(0.05)
            seen: dict[int, float] = {}
            arrived = threading.Condition()
            watch = client.watch_adapters()

            def follow() -> None:
                for e in watch:
                    with arrived:
                        seen[e.version] = time.perf_counter()
                        arrived.notify_all()

            threading.Thread(target=follow, daemon=True).start()
            admin.load_adapter("hot", str(tmp / "adapters" / "one"))
            loads, events, fetches, shm_fetches = [], [], [], []
            for i in range(args.swaps):
                source = tmp / "adapters" / ("two", "one")[i % 2]
                t0 = time.perf_counter()
                status = admin.load_adapter("hot", str(source))
                t1 = time.perf_counter()
                with arrived:
                    arrived.wait_for(lambda v=status.version: v in seen, timeout=60)
                loads.append(t1 - t0)
                events.append(seen[status.version] - t0)
                t2 = time.perf_counter()
                client.fetch_adapter("hot", 0, 2, transport="grpc")
                fetches.append(time.perf_counter() - t2)
                t3 = time.perf_counter()  # first shm fetch of the version: builds its pack
                held = client.fetch_adapter("hot", 0, 2, transport="shm")
                shm_fetches.append(time.perf_counter() - t3)
                del held
            watch.close()
            admin.close()
            client.close()
        finally:
            daemon.terminate()
            daemon.wait(30)
            log.close()
    mb = statistics.mean(sizes) / 1e6
    print(
        f"adapter: {mb:.1f} MB fp32 (r={args.rank}, {len(TARGETS)} modules x 4 layers), "
        f"{args.swaps} replaces, host {os.cpu_count()} CPUs"
    )
    print(f"{'':34} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}")
    for label, xs in (
        ("LoadAdapter call (replace)", loads),
        ("load start -> watch event", events),
        ("FetchAdapter rank 0 of TP=2 (gRPC)", fetches),
        ("same over shm (new version's pack)", shm_fetches),
    ):
        q = sorted(xs)
        p90 = q[min(len(q) - 1, int(0.9 * len(q)))]
        print(
            f"{label:34} {statistics.median(q) * 1e3:>10.1f} {p90 * 1e3:>8.1f} {q[-1] * 1e3:>8.1f}"
        )


if __name__ == "__main__":
    main()
