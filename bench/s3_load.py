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
* ``single``: boto3 ``get_object`` of each file in turn, one stream, written to
  a fresh directory (what a plain ``aws s3 cp`` of the files does, minus its threads);
* ``single-checked``: the same stream computing, inline, what weightd checks of every
  byte on its way in (each file's SHA-256 and every tensor's BLAKE3): the floor for a
  download that checks what it receives, on this host.

Each peer's CPU seconds (its process, or this one for the in-process streams) and the
store's (the ``weed`` process) are recorded beside the time: on a small host the store
and the client share the cores, and the CPU shows which of them bounds a peer.

Bytes fetched are what each one received from the store (weightd: its own counter;
the others: the objects' sizes, which they read whole). Usage:
``python bench/s3_load.py [--dir /tmp/weightd-bench-s3] [--repeat 3] [--layers 10]``.
Results go to stdout and bench/results/s3_load.json, with the load averages per round.
Needs the ``[s3]`` extra and, for the streamer, ``pip install 'weightd[bench]'``
(``--skip-runai`` runs without it).
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


def run_weightd(
    endpoint: str, work: Path, extra: list[str], trust_key: Path
) -> tuple[float, int, float | None]:
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
        *extra,
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
        print(f"  weightd timeline (s after its start event): {_timeline(text)}", flush=True)
        cpu = re.search(r"download phase=done source=b .*? process_cpu_s=([0-9.]+)", text)
        download_cpu = float(cpu.group(1)) if cpu else None
        print(
            f"  weightd: download {download.group(1) if download else '?'} s "
            f"({download_cpu if download_cpu is not None else '?'} CPU-s), "
            f"verify {verify.group(1) if verify else '?'} s, "
            f"local pass: {hashed.group(0) if hashed else 'none (digests from the download)'}",
            flush=True,
        )
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(work / "cache", ignore_errors=True)
    return seconds, fetched, download_cpu


def _timeline(log: str) -> dict[str, float]:
    """Seconds from the daemon's ``start`` event to each later milestone (its own clock)."""
    import datetime

    marks = {
        "listening": "listening listener=worker",
        "download_start": "download phase=start",
        "download_done": "download phase=done",
        "verified": "verified model=b",
        "serving": "serving models=",
    }
    when: dict[str, datetime.datetime] = {}
    for line in log.splitlines():
        stamp = line[:23]
        for name, text in [("start", "start pid="), *marks.items()]:
            if name not in when and text in line:
                when[name] = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
    if "start" not in when:
        return {}
    return {k: round((v - when["start"]).total_seconds(), 3) for k, v in when.items()}


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


class _Checks:
    """What weightd computes of each file on its way in, done inline on one stream: the
    file's SHA-256 and every tensor's BLAKE3 (the floor for a checked download)."""

    def __init__(self, name: str) -> None:
        import hashlib

        self.sha = hashlib.sha256()
        self.safetensors = name.endswith(".safetensors")
        self.pos = 0
        self.head = bytearray()
        self.tensors: list[tuple[int, int]] | None = None
        self.current: Any = None
        self.digests: list[str] = []

    def update(self, chunk: bytes) -> None:
        import blake3

        at, self.pos = self.pos, self.pos + len(chunk)
        self.sha.update(chunk)
        if not self.safetensors:
            return
        if self.tensors is None:
            self.head += chunk
            if len(self.head) < 8:
                return
            n = int.from_bytes(self.head[:8], "little")
            if len(self.head) < 8 + n:
                return
            header = json.loads(bytes(self.head[8 : 8 + n]))
            spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
            self.tensors = sorted((8 + n + a, 8 + n + b) for a, b in spans)
            self.head = bytearray()
        view = memoryview(chunk)
        while self.tensors:
            a, b = self.tensors[0]
            if a >= self.pos:
                return
            self.current = self.current or blake3.blake3()
            lo, hi = max(a, at), min(b, self.pos)
            if lo < hi:
                self.current.update(view[lo - at : hi - at])
            if b > self.pos:
                return
            self.digests.append(self.current.hexdigest())
            self.current = None
            self.tensors.pop(0)


def run_single(
    endpoint: str, keys: list[str], work: Path, checked: bool = False
) -> tuple[float, int]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    client = s3_client(endpoint, ACCESS, SECRET)
    start = time.monotonic()
    total = 0
    for key in keys:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
        checks = _Checks(key) if checked else None
        with open(work / os.path.basename(key), "wb") as f:
            while chunk := body.read(8 << 20):
                f.write(chunk)
                if checks is not None:
                    checks.update(chunk)
                total += len(chunk)
            f.flush()
            os.fsync(f.fileno())
    seconds = time.monotonic() - start
    shutil.rmtree(work, ignore_errors=True)
    return seconds, total


def _rusage(children: bool) -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_of(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by these processes."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _store_pids(marker: str) -> list[int]:
    """The store's processes (their command line names its data directory)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


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
        store = _store_pids(scratch)
        peers = ["weightd", "runai", "single", "single-checked"]
        for i in range(args.repeat):
            rnd: dict[str, Any] = {}
            for who in peers if i % 2 == 0 else peers[::-1]:
                if who == "runai" and args.skip_runai:
                    continue
                store0, child0, self0 = _cpu_of(store), _rusage(True), _rusage(False)
                if who == "weightd":
                    rnd[who] = run_weightd(
                        endpoint, work, args.weightd_args.split(), Path(f"{key}.pub")
                    )
                elif who == "runai":
                    rnd[who] = run_runai(endpoint, keys)
                else:
                    rnd[who] = run_single(endpoint, keys, work, who == "single-checked")
                rnd[f"{who}_cpu"] = {
                    "client_s": _rusage(True) - child0 + _rusage(False) - self0,
                    "store_s": _cpu_of(store) - store0,
                }
                print(f"round {i} {who}: {rnd[who]} cpu {rnd[f'{who}_cpu']}", flush=True)
            rnd["loadavg"] = os.getloadavg()
            print(f"round {i} load averages: {rnd['loadavg']}", flush=True)
            results["rounds"].append(rnd)
    summary: dict[str, Any] = {}
    for who in ("weightd", "runai", "single", "single-checked"):
        times = [r[who][0] for r in results["rounds"] if who in r]
        if times:
            cpu = [r[f"{who}_cpu"] for r in results["rounds"] if who in r]
            summary[who] = {
                "median_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "bytes": results["rounds"][-1][who][1],
                "gb_per_s": size / statistics.median(times) / 1e9,
                "client_cpu_s": statistics.median(c["client_s"] for c in cpu),
                "store_cpu_s": statistics.median(c["store_s"] for c in cpu),
            }
    results["summary"] = summary
    # The download's own CPU, without the daemon's start (its interpreter, imports and
    # servers), which an in-process stream does not pay: the per-byte comparison.
    download_cpu = [r["weightd"][2] for r in results["rounds"] if "weightd" in r]
    if "weightd" in summary and None not in download_cpu:
        summary["weightd"]["download_cpu_s"] = statistics.median(download_cpu)
    if "weightd" in summary:
        for who in ("single", "single-checked"):
            if who in summary:
                summary[f"weightd_cpu_over_{who}"] = (
                    summary["weightd"]["client_cpu_s"] / summary[who]["client_cpu_s"]
                )
                if "download_cpu_s" in summary["weightd"]:
                    summary[f"weightd_download_cpu_over_{who}"] = (
                        summary["weightd"]["download_cpu_s"] / summary[who]["client_cpu_s"]
                    )
        for who in ("runai", "single", "single-checked"):
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
