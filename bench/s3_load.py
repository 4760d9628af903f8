"""Start to SERVING from object storage: weightd against Run:ai's model streamer and a
plain single-stream download, alternating in one run, all from one local SeaweedFS.

A ~1.1 GiB Llama-style bf16 checkpoint (TinyLlama widths, 10 layers; generated, never
downloaded) is uploaded once, with its manifest. Each round, in turn:

* ``weightd``: a fresh cache directory, ``weightd serve --model b=s3://...
  --manifest s3://...`` as a real process, timed from exec to health SERVING: listing,
  manifest check, the concurrent ranged GETs, per-file SHA-256, then the full local
  verification (every tensor's BLAKE3), ready to serve every rank on the host;
* ``runai``: ``runai-model-streamer`` (its S3 extra) streaming the same objects from
  the same endpoint into CPU tensors (each cloned, as its buffers are reused), timed
  in a fresh process from exec to the last tensor; it verifies nothing and serves no
  one else: one process's copy;
* ``single-stream``: boto3 ``get_object`` of each file in turn, one stream, written to
  a fresh directory (what a plain ``aws s3 cp`` of the files does, minus its threads).

Bytes fetched are what each one received from the store (weightd: its own counter;
the others: the objects' sizes, which they read whole). Usage:
``python bench/s3_load.py [--dir /tmp/weightd-bench-s3] [--repeat 3] [--layers 10]``.
Results go to stdout and bench/results/s3_load.json. Needs the ``[s3]`` extra and, for
the streamer, ``pip install 'weightd[bench]'`` (``--skip-runai`` runs without it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "server"), str(ROOT / "client")]

from bench.ckpt import BENCH_CONFIG, write_checkpoint  # noqa: E402
from bench.seaweed import s3_client, seaweed_s3  # noqa: E402

ACCESS, SECRET = "weightd-bench", "weightd-bench-secret"
BUCKET, PREFIX = "bench", "llama/"

RUNAI = """
import sys, time
from runai_model_streamer import SafetensorsStreamer
files = sys.argv[1:]
n = 0
with SafetensorsStreamer() as s:
    s.stream_files(files)
    for _name, t in s.get_tensors():
        n += t.clone().numel() * t.element_size()
print(n)
"""


def _env(endpoint: str) -> dict[str, str]:
    return dict(
        os.environ,
        AWS_ACCESS_KEY_ID=ACCESS,
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ENDPOINT_URL=endpoint,
        RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
        PYTHONPATH=os.pathsep.join([str(ROOT / "server"), str(ROOT / "client"), str(ROOT)]),
    )


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels.get("kind", "model") == "model":
                return float(s.value)
    return 0.0


def run_weightd(endpoint: str, work: Path, extra: list[str], trust_key: Path) -> tuple[float, int]:
    # tests.health, not tests.conftest: no pytest needed to run the benchmark.
    from tests.health import listening_address, wait_serving

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sock = work / "run" / "w.sock"
    log = work / "daemon.log"
    cmd = [
        sys.executable,
        "-m",
        "weightd.server.cli.main",
        "serve",
        "--listen",
        f"unix://{sock}",
        "--model",
        f"b=s3://{BUCKET}/{PREFIX}",
        "--manifest",
        f"b=s3://{BUCKET}/manifest.json",
        "--trust-key",  # an s3:// manifest is a trust root only when signed
        str(trust_key),
        "--s3-endpoint",
        endpoint,
        "--cache-dir",
        str(work / "cache"),
        "--metrics-listen",
        "127.0.0.1:0",
        "--watch-interval",
        "0",
    ]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env(endpoint))
    try:
        while not sock.exists():
            if proc.poll() is not None:
                raise RuntimeError(log.read_text())
            time.sleep(0.01)
        wait_serving(f"unix://{sock}", proc, log, timeout=3600, poll=0.02)
        seconds = time.monotonic() - start
        url = listening_address(log.read_text(), "metrics")
        assert url is not None
        fetched = int(_metric(url, "weightd_source_downloaded_bytes_total"))
        text = log.read_text()
        download = re.search(r"download phase=done source=b .*? seconds=([0-9.]+)", text)
        verify = re.search(r"verified model=b .*? seconds=([0-9.]+)", text)
        hashed = re.search(r"hashed b: .*", text)
        print(
            f"  weightd: download {download.group(1) if download else '?'} s, "
            f"verify {verify.group(1) if verify else '?'} s, "
            f"local pass: {hashed.group(0) if hashed else 'none (digests from the download)'}",
            flush=True,
        )
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(work / "cache", ignore_errors=True)
    return seconds, fetched


def run_runai(endpoint: str, keys: list[str]) -> tuple[float, int]:
    files = [f"s3://{BUCKET}/{k}" for k in keys if k.endswith(".safetensors")]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", RUNAI, *files],
        check=False,
        capture_output=True,
        text=True,
        env=_env(endpoint),
        timeout=1800,
    )
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return seconds, int(done.stdout.split()[-1])


def run_single(endpoint: str, keys: list[str], work: Path) -> tuple[float, int]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    client = s3_client(endpoint, ACCESS, SECRET)
    start = time.monotonic()
    total = 0
    for key in keys:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
        with open(work / os.path.basename(key), "wb") as f:
            while chunk := body.read(8 << 20):
                f.write(chunk)
                total += len(chunk)
            f.flush()
            os.fsync(f.fileno())
    seconds = time.monotonic() - start
    shutil.rmtree(work, ignore_errors=True)
    return seconds, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "weightd-bench-s3"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--layers", type=int, default=10, help="decoder layers (10: ~1.1 GiB)")
    p.add_argument("--skip-runai", action="store_true")
    p.add_argument("--weightd-args", default="", help="extra serve flags: '--s3-concurrency 2'")
    args = p.parse_args()
    top = Path(args.dir)
    top.mkdir(parents=True, exist_ok=True)
    ckpt = write_checkpoint(
        top / f"ckpt-{args.layers}", {**BENCH_CONFIG, "num_hidden_layers": args.layers}
    )
    files = sorted(
        f for f in ckpt.iterdir() if f.is_file() and f.suffix in (".json", ".safetensors")
    )
    manifest = top / f"manifest-{args.layers}.signed.json"
    key = top / "bench.key"
    cli = [sys.executable, "-m", "weightd.server.cli.main", "manifest"]
    if not key.exists():
        keygen = ["keygen", "--out-private", str(key), "--out-public", f"{key}.pub"]
        subprocess.run([*cli, *keygen], check=True, env=_env(""))
    if not manifest.exists():
        create = ["create", str(ckpt), "-o", str(manifest), "--sign-key", str(key)]
        subprocess.run([*cli, *create], check=True, env=_env(""))
    listed = json.loads(manifest.read_text())["files"]
    files = [f for f in files if f.name in listed]
    size = sum(f.stat().st_size for f in files)
    results: dict[str, Any] = {"checkpoint_bytes": size, "files": len(files), "rounds": []}
    with (
        tempfile.TemporaryDirectory(dir=top) as scratch,
        seaweed_s3(Path(scratch), ACCESS, SECRET) as endpoint,
    ):
        client = s3_client(endpoint, ACCESS, SECRET)
        client.create_bucket(Bucket=BUCKET)
        for f in files:
            client.upload_file(str(f), BUCKET, PREFIX + f.name)
        client.upload_file(str(manifest), BUCKET, "manifest.json")
        keys = [PREFIX + f.name for f in files]
        work = Path(scratch) / "work"
        for i in range(args.repeat):
            rnd: dict[str, Any] = {}
            order = ["weightd", "runai", "single"] if i % 2 == 0 else ["single", "runai", "weightd"]
            for who in order:
                if who == "weightd":
                    rnd[who] = run_weightd(
                        endpoint, work, args.weightd_args.split(), Path(f"{key}.pub")
                    )
                elif who == "runai" and not args.skip_runai:
                    rnd[who] = run_runai(endpoint, keys)
                elif who == "single":
                    rnd[who] = run_single(endpoint, keys, work)
                print(f"round {i} {who}: {rnd.get(who)}", flush=True)
            rnd["loadavg"] = os.getloadavg()
            print(f"round {i} load averages: {rnd['loadavg']}", flush=True)
            results["rounds"].append(rnd)
    summary = {}
    for who in ("weightd", "runai", "single"):
        times = [r[who][0] for r in results["rounds"] if who in r]
        if times:
            summary[who] = {
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "bytes": results["rounds"][-1][who][1],
                "gb_per_s": size / statistics.median(times) / 1e9,
            }
    results["summary"] = summary
    if "weightd" in summary:
        for who in ("runai", "single"):
            if who in summary:
                summary[f"{who}_over_weightd"] = (
                    summary[who]["median_s"] / summary["weightd"]["median_s"]
                )
                summary[f"weightd_over_{who}"] = (
                    summary["weightd"]["median_s"] / summary[who]["median_s"]
                )
    summary["loadavg_end"] = os.getloadavg()
    print(json.dumps(summary, indent=2))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "s3_load.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
