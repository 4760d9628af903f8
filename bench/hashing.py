"""How fast weightd verifies a checkpoint, against this machine's own ceilings.

Generates (once, in /tmp, never committed) a ~2 GiB Llama-style bf16 checkpoint with
TinyLlama's widths in 4 shards, then measures in one run, so ratios are comparable:

* ceilings: memcpy into existing memory (numpy ``copyto``), single-thread
  ``hashlib.sha256`` and ``blake3`` over a buffer in memory, reading the checkpoint
  once from the page cache;
* weightd's one-pass hashing with the checkpoint in the page cache: as ``weightd
  verify`` does it (file SHA-256 + per-tensor BLAKE3, shards in parallel) and as a
  plain ``weightd serve`` does it (per-tensor BLAKE3 only);
* cold: each shard evicted from the page cache (``posix_fadvise(DONTNEED)``), then
  reading the checkpoint once, and — evicted again — a full ``verify_checkpoint``.
  Eviction is judged by time: a "cold" read not clearly slower than a warm one means
  it did not work, and the report says so;
* restart: loading with the hash cache filled (what a daemon restart costs), in
  process and as a real ``weightd serve`` process up to SERVING, against
  ``--reverify``.

Usage: ``python bench/hashing.py [--dir /tmp/weightd-bench-2g] [--repeat 3]``.
Results go to stdout and bench/results/hashing.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import numpy as np

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
SHARDS = 4


def _params() -> list[tuple[str, tuple[int, ...]]]:
    c = CONFIG
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def generate(directory: Path) -> None:
    """Write the checkpoint (bf16 bit patterns from a seeded generator)."""
    if (directory / "model.safetensors.index.json").exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    params = _params()
    total = sum(2 * int(np.prod(s)) for _, s in params)
    per = total / SHARDS
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    acc = 0
    for name, shape in params:
        if acc >= per * len(groups) and len(groups) < SHARDS:
            groups.append([])
        groups[-1].append((name, shape))
        acc += 2 * int(np.prod(shape))
    rng = np.random.default_rng(20261202)
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in group:
            n = 2 * int(np.prod(shape))
            header[name] = {
                "dtype": "BF16",
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(directory / (file + ".tmp"), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for _name, shape in group:
                # finite bf16 values: small normals, as bit patterns
                x = rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02
                f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
        os.replace(directory / (file + ".tmp"), directory / file)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_once(paths: list[Path], block: int = 8 << 20) -> int:
    buf = bytearray(block)
    view = memoryview(buf)
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while n := os.readv(fd, [view]):
                total += n
        finally:
            os.close(fd)
    return total


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def memory_ceilings(repeat: int) -> dict[str, float]:
    """memcpy into existing memory and single-thread hashes, over 256 MiB in memory."""
    buf = np.random.default_rng(1).integers(0, 255, 256 << 20, dtype=np.uint8)
    dst = np.empty_like(buf)
    np.copyto(dst, buf)
    gb = buf.nbytes / 1e9
    return {
        "memcpy_GBps": gb / timed(lambda: np.copyto(dst, buf), repeat),
        "sha256_1thread_GBps": gb / timed(lambda: hashlib.sha256(buf.data).digest(), repeat),
        "blake3_1thread_GBps": gb / timed(lambda: blake3.blake3(buf.data).digest(), repeat),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/weightd-bench-2g")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from weightd.server.trust.verify import VerifyOptions, verify_checkpoint

    directory = Path(args.dir)
    t = time.perf_counter()
    generate(directory)
    files = shards(directory)
    size = sum(p.stat().st_size for p in files)
    print(
        f"checkpoint: {directory}, {len(files)} shards, {size / (1 << 30):.2f} GiB "
        f"(ready in {time.perf_counter() - t:.1f}s); {os.cpu_count()} cores"
    )
    gb = size / 1e9
    out: dict[str, float | str] = {"bytes": size, "cores": os.cpu_count() or 0}

    out.update(memory_ceilings(args.repeat))

    # --- warm page cache ---
    read_once(files)
    out["read_warm_GBps"] = gb / timed(lambda: read_once(files), args.repeat)
    # what `weightd verify` / a manifest check does: file SHA-256 + per-tensor BLAKE3
    quiet = VerifyOptions(progress=False, file_sha256=True)
    # what plain `weightd serve` does: per-tensor BLAKE3 only
    serving = VerifyOptions(progress=False, file_sha256=False)

    def verify(options: VerifyOptions = quiet) -> None:
        v = verify_checkpoint(str(directory), None, options)
        v.store.close()
        assert v.ok, [str(p) for p in v.problems][:3]

    out["verify_warm_GBps"] = gb / timed(verify, args.repeat)
    # CPU efficiency, robust to other load on a shared machine: bytes per CPU-second
    # spent (all threads) against the cost of the two hashes done back to back.
    cpu = time.process_time()
    verify()
    out["verify_GB_per_cpu_s"] = gb / (time.process_time() - cpu)
    out["sha256_then_blake3_GB_per_cpu_s"] = 1 / (
        1 / float(out["sha256_1thread_GBps"]) + 1 / float(out["blake3_1thread_GBps"])
    )
    out["read_sha256_blake3_GB_per_cpu_s"] = 1 / (
        1 / float(out["sha256_1thread_GBps"])
        + 1 / float(out["blake3_1thread_GBps"])
        + 1 / float(out["read_warm_GBps"])
    )
    out["load_average_1min"] = os.getloadavg()[0]
    # one shard at a time (its reader and two hashing lanes still run in parallel)
    one = VerifyOptions(progress=False, threads=1, file_sha256=True)
    out["verify_warm_one_shard_at_a_time_GBps"] = gb / timed(lambda: verify(one), args.repeat)
    out["load_blake3_only_warm_GBps"] = gb / timed(lambda: verify(serving), args.repeat)

    # --- cold: evicted before each run ---
    def cold(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(args.repeat):
            evict(files)
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    read_cold_s = cold(lambda: read_once(files))
    verify_cold_s = cold(verify)
    out["load_blake3_only_cold_s"] = cold(lambda: verify(serving))
    out["read_cold_s"] = read_cold_s
    out["read_cold_GBps"] = gb / read_cold_s
    out["verify_cold_s"] = verify_cold_s
    out["verify_cold_GBps"] = gb / verify_cold_s
    warm_read_s = gb / float(out["read_warm_GBps"])
    out["eviction"] = (
        f"worked (cold read {read_cold_s / warm_read_s:.1f}x slower than warm)"
        if read_cold_s > 1.5 * warm_read_s
        else "DID NOT WORK (cold read not slower than warm): cold figures are warm"
    )

    # --- restart with the hash cache ---
    with tempfile.TemporaryDirectory(prefix="weightd-bench-cache-") as cache:
        cached = VerifyOptions(progress=False, hash_cache_dir=os.path.join(cache, "hashes"))
        verify(cached)  # fills the cache
        out["restart_cached_in_process_s"] = timed(lambda: verify(cached), args.repeat)
        out["serve_to_serving_cached_s"] = timed(
            lambda: serve_until_serving(directory, cache, []), 1
        )
        out["serve_to_serving_reverify_s"] = timed(
            lambda: serve_until_serving(directory, cache, ["--reverify"]), 1
        )

    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"  {k:<{width}}  {v:.3f}" if isinstance(v, float) else f"  {k:<{width}}  {v}")
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / "hashing.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


def serve_until_serving(directory: Path, cache: str, extra: list[str]) -> None:
    """Start a real ``weightd serve`` and stop it as soon as health says SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with tempfile.TemporaryDirectory(prefix="wdb-", dir="/tmp") as run:
        sock = f"{run}/s.sock"
        cmd = [
            sys.executable,
            "-m",
            "weightd.server.cli.main",
            "serve",
            "--model",
            str(directory),
            "--listen",
            f"unix://{sock}",
            *extra,
        ]
        proc = subprocess.Popen(
            [*cmd, "--cache-dir", cache], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"weightd serve exited with {proc.returncode}")
                if os.path.exists(sock):
                    with grpc.insecure_channel(f"unix://{sock}") as ch:
                        try:
                            reply = health_pb2_grpc.HealthStub(ch).Check(
                                health_pb2.HealthCheckRequest(service=""), timeout=1
                            )
                            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                                return
                        except grpc.RpcError:
                            pass
                time.sleep(0.02)
            raise RuntimeError("not SERVING in time")
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
