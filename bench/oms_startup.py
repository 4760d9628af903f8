"""Start-up of an OpenSSF-Model-Signing-signed checkpoint against the same checkpoint
with weightd's own signed manifest: real ``weightd serve`` processes, launch to SERVING.

The OMS signature's per-file SHA-256 is compared with the digests of weightd's own
pass (trust/oms.py), so the two should cost the same: one read of every byte, SHA-256
and per-tensor BLAKE3 together. This measures that claim.

Generates (once, in /tmp, never committed) a ~1 GiB Llama-style bf16 checkpoint in 4
shards, signs it both ways (``weightd manifest create --sign-key`` with an Ed25519 key;
the ``model_signing`` library's key signer with an EC P-256 key, the signature outside
the directory), then starts ``weightd serve --reverify`` (the hash cache cannot skip the
hashing) alternately with each trust root, ``--rounds`` times each, the order swapped
every round so drift in the machine's load falls on both alike. The first start of each
is a warm-up (page cache), not counted.

Usage: ``python bench/oms_startup.py [--dir /tmp/weightd-bench-oms-1g] [--rounds 5]``.
Results (each run's wall and CPU seconds, the medians, their ratios, the CPU cost of
importing the library alone, the load average before and after) go to stdout and
bench/results/oms_startup.json. On a shared machine the CPU seconds are the steadier
figure: the others' load stretches wall time, not the work done.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from bench.checkpoint import make_checkpoint
from bench.hashing import serve_until_serving


def _weightd(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "weightd.server.cli.main", *args],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _sign_both(model: Path, keys: Path) -> tuple[list[str], list[str]]:
    """The serve arguments of each trust root: (weightd manifest, OMS signature)."""
    import model_signing

    keys.mkdir(parents=True, exist_ok=True)
    manifest = keys / "manifest.json"
    if not manifest.exists():
        _weightd("manifest", "keygen", "--out-private", str(keys / "ed.key"),
                 "--out-public", str(keys / "ed.pub"))  # fmt: skip
        _weightd("manifest", "create", str(model), "-o", str(manifest),
                 "--sign-key", str(keys / "ed.key"))  # fmt: skip
    signature = keys / "model.sig"
    if not signature.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        (keys / "ec.pem").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        (keys / "ec.pub").write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        model_signing.signing.Config().use_elliptic_key_signer(private_key=keys / "ec.pem").sign(
            model, signature
        )
    return (
        ["--manifest", str(manifest), "--trust-key", str(keys / "ed.pub")],
        ["--signature", str(signature), "--trust-key", str(keys / "ec.pub")],
    )


def _children_cpu() -> float:
    """CPU seconds (user + system) of every child process waited for so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/weightd-bench-oms-1g")
    p.add_argument("--size", type=int, default=1 << 30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    model = make_checkpoint(Path(args.dir) / "model", args.size, shards=4)
    manifest_args, oms_args = _sign_both(model, Path(args.dir) / "keys")
    peers = {"manifest": manifest_args, "oms": oms_args}
    times: dict[str, list[float]] = {k: [] for k in peers}
    cpu: dict[str, list[float]] = {k: [] for k in peers}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="wdb-oms-", dir="/tmp") as cache:
        for extra in peers.values():  # warm-up: page cache, imports
            serve_until_serving(model, cache, [*extra, "--reverify"])
        for r in range(args.rounds):
            order = list(peers) if r % 2 == 0 else list(reversed(peers))
            for name in order:
                before = _children_cpu()
                started = time.monotonic()
                serve_until_serving(model, cache, [*peers[name], "--reverify"])
                times[name].append(time.monotonic() - started)
                cpu[name].append(_children_cpu() - before)
                print(
                    f"round {r} {name:<8} {times[name][-1]:.2f} s, {cpu[name][-1]:.2f} CPU s",
                    flush=True,
                )
        # The fixed cost the OMS path adds: importing the library's verifiers as weightd
        # does (trust/oms.py), against the package's own eager import (Sigstore's stack),
        # each over the same base (weightd's trust module imported first).
        base = "from weightd.server.trust import oms"
        imports: dict[str, list[float]] = {"base": [], "weightd": [], "eager": []}
        for _ in range(args.rounds):
            for kind, code in (
                ("base", base),
                ("weightd", base + "; oms._library()"),
                ("eager", base + "; import model_signing"),
            ):
                before = _children_cpu()
                subprocess.run([sys.executable, "-c", code], check=True)
                imports[kind].append(_children_cpu() - before)
    load_after = os.getloadavg()
    size = sum(f.stat().st_size for f in model.iterdir() if f.is_file())
    medians = {k: statistics.median(v) for k, v in times.items()}
    cpu_medians = {k: statistics.median(v) for k, v in cpu.items()}
    out = {
        "checkpoint_bytes": size,
        "rounds": args.rounds,
        "seconds": times,
        "median_seconds": medians,
        "ratio_oms_over_manifest": medians["oms"] / medians["manifest"],
        "cpu_seconds": cpu,
        "median_cpu_seconds": cpu_medians,
        "cpu_ratio_oms_over_manifest": cpu_medians["oms"] / cpu_medians["manifest"],
        "import_cpu_seconds_median": {k: statistics.median(v) for k, v in imports.items()},
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(out, indent=2))
    results = Path(args.out)
    results.mkdir(parents=True, exist_ok=True)
    (results / "oms_startup.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
