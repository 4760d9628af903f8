"""Models served from a real S3-compatible store (SeaweedFS), against the same models
served from local directories: identical bytes, resumed and warm downloads, and every
failure the store can throw at a download, each refused with one precise line."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch

from bench.seaweed import free_ports
from tests.conftest import run_daemon, weightd_command
from tests.s3.conftest import (
    SECRET_KEY,
    WRONG_SECRET,
    SeaweedS3,
    make_key,
    make_manifest,
    metric,
    scrape,
    write_blob_model,
)
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient

pytestmark = pytest.mark.e2e

BYTES = "weightd_source_downloaded_bytes_total"
DOWNLOADS = "weightd_source_downloads_total"


def _env(monkeypatch: pytest.MonkeyPatch, seaweed: SeaweedS3, secret: str = SECRET_KEY) -> None:
    for key, value in seaweed.env(secret).items():
        monkeypatch.setenv(key, value)


def _serve_fails(
    tmp: Path, args: list[str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``weightd serve`` expecting a start-up failure; return its output."""
    sock = tmp / "run" / "weightd.sock"
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp / "cache"))
    done = subprocess.run(
        weightd_command("serve", "--listen", f"unix://{sock}", *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    return done


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype and torch.equal(tensor, b[name]), name


def test_model_from_store_is_bit_identical_and_a_warm_restart_downloads_nothing(
    seaweed: SeaweedS3,
    transformers_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = transformers_models["llama-gqa"]
    bucket = seaweed.bucket()
    seaweed.upload_dir(local, bucket, "llama/")
    # An s3:// manifest is a trust root only when signed by a --trust-key.
    private, public = make_key(tmp_path)
    manifest = make_manifest(local, tmp_path / "manifest.json", private)
    key = "manifests/llama.json"
    seaweed.client().put_object(Bucket=bucket, Key=key, Body=manifest.read_bytes())
    _env(monkeypatch, seaweed)
    # What the manifest lists is what is downloaded (generation_config.json is not).
    total = sum(f["size"] for f in json.loads(manifest.read_text())["files"].values())
    models = [("local", local), ("remote", f"s3://{bucket}/llama/")]
    extra = [
        "--s3-endpoint",
        seaweed.endpoint,
        "--manifest",
        f"remote=s3://{bucket}/{key}",
        "--trust-key",
        str(public),
        "--metrics-listen",
        "127.0.0.1:0",
        "--s3-part-bytes",
        str(64 << 10),
    ]
    with run_daemon(tmp_path, models, extra) as d:
        with WeightClient(d.target, timeout=60) as client:
            for rank in range(2):
                _same(
                    client.fetch(rank, 2, model="local", transport="grpc"),
                    client.fetch(rank, 2, model="remote", transport="grpc"),
                )
        text = scrape(d.address("metrics"))
        assert metric(text, BYTES, {"kind": "model"}) == total
        assert metric(text, DOWNLOADS, {"kind": "model", "outcome": "downloaded"}) == 1
        log = d.log()
        assert "download phase=done source=remote" in log and "outcome=downloaded" in log
        assert SECRET_KEY not in log
        # Each byte was hashed once, on its way in: the local verification found every
        # shard's digests from the download, and hashed none of them again.
        assert "remote: all 11 shards unchanged since hashed (hash cache)" in log, log
        assert "hashed remote" not in log
    with run_daemon(tmp_path, models, extra) as d:
        with WeightClient(d.target, timeout=60) as client:
            _same(client.fetch(1, 2, model="local"), client.fetch(1, 2, model="remote"))
        text = scrape(d.address("metrics"))
        assert metric(text, BYTES, {"kind": "model"}) == 0
        assert metric(text, DOWNLOADS, {"kind": "model", "outcome": "warm"}) == 1


def _journal_bytes(cache: Path) -> int:
    for journal in cache.glob("sources/*/v-*.partial/.journal.json"):
        with_done = json.loads(journal.read_text())["done"]
        return sum(b - a for ranges in with_done.values() for a, b in ranges)
    return 0


def test_resume_after_the_daemon_is_killed_mid_download(
    seaweed: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = write_blob_model(tmp_path / "blob", 6)
    total = sum(p.stat().st_size for p in local.iterdir())
    bucket = seaweed.bucket()
    seaweed.upload_dir(local, bucket, "blob/")
    manifest = make_manifest(local, tmp_path / "manifest.json")
    _env(monkeypatch, seaweed)
    source = f"s3://{bucket}/blob/"
    common = ["--s3-endpoint", seaweed.endpoint, "--manifest", str(manifest)]
    slow = [
        *common,
        "--s3-part-bytes",
        str(256 << 10),
        "--s3-concurrency",
        "2",
        "--s3-max-bytes-per-second",
        str(1 << 20),
    ]
    sock = tmp_path / "run" / "weightd.sock"
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp_path / "cache"))
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(
            weightd_command(
                "serve", "--listen", f"unix://{sock}", "--model", f"blob={source}", *slow
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 60
        while _journal_bytes(tmp_path / "cache") < (1 << 20):
            assert first.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "no progress in the journal"
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    kept = _journal_bytes(tmp_path / "cache")
    assert 0 < kept < total
    extra = [*common, "--metrics-listen", "127.0.0.1:0"]
    with run_daemon(tmp_path, [("blob", source)], extra) as d:  # type: ignore[list-item]
        text = scrape(d.address("metrics"))
        fetched = metric(text, BYTES, {"kind": "model"})
        assert 0 < fetched <= total - kept
        assert metric(text, DOWNLOADS, {"kind": "model", "outcome": "resumed"}) == 1
        from safetensors.torch import load_file

        with WeightClient(d.target, timeout=60) as client:
            _same(client.fetch(0, 1), load_file(str(local / "model.safetensors")))


def test_object_replaced_mid_download_is_an_error_naming_it(
    seaweed: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = write_blob_model(tmp_path / "blob", 4)
    bucket = seaweed.bucket()
    seaweed.upload_dir(local, bucket, "blob/")
    _env(monkeypatch, seaweed)
    sock = tmp_path / "run" / "weightd.sock"
    env = dict(os.environ, WEIGHTD_CACHE_DIR=str(tmp_path / "cache"))
    args = [
        "serve",
        "--listen",
        f"unix://{sock}",
        "--model",
        f"blob=s3://{bucket}/blob/",
        "--s3-endpoint",
        seaweed.endpoint,
        "--trust-object-store",
        "--s3-part-bytes",
        str(256 << 10),
        "--s3-concurrency",
        "1",
        "--s3-max-bytes-per-second",
        str(1 << 20),
    ]
    daemon = subprocess.Popen(
        weightd_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        deadline = time.monotonic() + 60
        while _journal_bytes(tmp_path / "cache") == 0:
            assert daemon.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        data = bytearray((local / "model.safetensors").read_bytes())
        data[-1] ^= 0xFF  # same size, other bytes: only the ETag tells
        key = "blob/model.safetensors"
        seaweed.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
        out, _ = daemon.communicate(timeout=120)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert daemon.returncode == 1, out
    assert f"s3://{bucket}/{key}: the object changed since its download began" in out
    assert not list((tmp_path / "cache").glob("sources/*/v-*[0-9a-f]/model.safetensors"))


def test_bucket_modified_after_the_manifest_is_refused(
    seaweed: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = write_blob_model(tmp_path / "blob", 4)
    manifest = make_manifest(local, tmp_path / "manifest.json")
    _env(monkeypatch, seaweed)
    data = bytearray((local / "model.safetensors").read_bytes())
    # Same size, one byte of the first tensor flipped: refused once that tensor is down,
    # the rest of the shard never fetched, nothing kept, nothing served.
    bucket = seaweed.bucket()
    seaweed.upload_dir(local, bucket, "blob/")
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length + 100] ^= 1
    seaweed.client().put_object(Bucket=bucket, Key="blob/model.safetensors", Body=bytes(data))
    args = [
        "--model",
        f"blob=s3://{bucket}/blob/",
        "--s3-endpoint",
        seaweed.endpoint,
        "--manifest",
        str(manifest),
        "--s3-part-bytes",
        str(256 << 10),
        "--s3-concurrency",
        "1",
        "--log-json",
    ]
    done = _serve_fails(tmp_path, args)
    assert re.search(
        rf"s3://{bucket}/blob/model.safetensors: tensor 'blob\.[ab]\.weight': blake3:[0-9a-f]+, "
        rf"manifest {re.escape(str(manifest))} says blake3:",
        done.stderr,
    ), done.stderr
    assert "the download stopped at this tensor" in done.stderr
    (failed,) = [
        json.loads(line)
        for line in (done.stdout + done.stderr).splitlines()
        if line.startswith("{") and '"phase": "failed"' in line
    ]
    assert 0 < failed["bytes"] < len(data) * 3 // 4  # a 2 MiB tensor, not the 4 MiB file
    assert not list((tmp_path / "cache").glob("sources/*/*/*.safetensors*"))
    # Another size: refused from the listing, before a byte is downloaded.
    bucket = seaweed.bucket()
    seaweed.upload_dir(local, bucket, "blob/")
    seaweed.client().put_object(Bucket=bucket, Key="blob/model.safetensors", Body=bytes(data[:-8]))
    args[1] = f"blob=s3://{bucket}/blob/"
    done = _serve_fails(tmp_path, args)
    assert "model.safetensors is" in done.stderr and "nothing was downloaded" in done.stderr
    assert '"phase": "start"' not in done.stdout + done.stderr


def test_wrong_credentials_endpoint_down_and_no_trust_root(
    seaweed: SeaweedS3,
    transformers_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = transformers_models["llama"]
    bucket = seaweed.bucket()
    seaweed.upload_dir(local, bucket, "llama/")
    source = f"blob=s3://{bucket}/llama/"
    _env(monkeypatch, seaweed, WRONG_SECRET)
    args = ["--model", source, "--s3-endpoint", seaweed.endpoint, "--trust-object-store"]
    done = _serve_fails(tmp_path, args)
    assert "access denied by the store" in done.stderr
    assert WRONG_SECRET not in done.stdout + done.stderr
    _env(monkeypatch, seaweed)
    (closed,) = free_ports(1)
    down = [
        "--model",
        source,
        "--s3-endpoint",
        f"http://127.0.0.1:{closed}",
        "--trust-object-store",
        "--s3-max-attempts",
        "2",
    ]
    done = _serve_fails(tmp_path, down)
    assert f"cannot reach the object store at http://127.0.0.1:{closed}" in done.stderr
    done = _serve_fails(tmp_path, ["--model", source, "--s3-endpoint", seaweed.endpoint])
    assert "an object store is not a trust root" in done.stderr
    missing = [
        "--model",
        f"x=s3://{bucket}/nothing-here/",
        "--s3-endpoint",
        seaweed.endpoint,
        "--trust-object-store",
    ]
    done = _serve_fails(tmp_path, missing)
    assert "no config.json under the prefix" in done.stderr
    nobucket = [
        "--model",
        "x=s3://no-such-bucket-here/m/",
        "--s3-endpoint",
        seaweed.endpoint,
        "--trust-object-store",
    ]
    done = _serve_fails(tmp_path, nobucket)
    assert "the bucket does not exist" in done.stderr


def test_reload_follows_the_store_and_other_models_keep_serving(
    seaweed: SeaweedS3,
    transformers_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from safetensors.torch import load_file

    v1 = write_blob_model(tmp_path / "v1", 1, seed=1)
    v2 = write_blob_model(tmp_path / "v2", 1, seed=2)
    bucket = seaweed.bucket()
    seaweed.upload_dir(v1, bucket, "blob/")
    # Hostile names in the bucket: never written to the cache, never served.
    for key in ("blob/nested/evil.json", "blob/.hidden.json", "blob/notes.txt"):
        seaweed.client().put_object(Bucket=bucket, Key=key, Body=b"{}")
    _env(monkeypatch, seaweed)
    models = [("blob", f"s3://{bucket}/blob/"), ("local", transformers_models["llama"])]
    extra = ["--s3-endpoint", seaweed.endpoint, "--trust-object-store"]
    with run_daemon(tmp_path, models, extra) as d:  # type: ignore[arg-type]
        admin = AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60)
        with WeightClient(d.target, timeout=60) as client:
            _same(client.fetch(0, 1, model="blob"), load_file(str(v1 / "model.safetensors")))
            cached = {p.name for p in (tmp_path / "cache").glob("sources/*/v-*/*")}
            assert cached == {"config.json", "model.safetensors"}
            seaweed.client().delete_object(Bucket=bucket, Key="blob/model.safetensors")
            with pytest.raises(Exception, match=r"model\.safetensors"):
                admin.reload("blob")  # a file gone from the store: the old version serves
            _same(client.fetch(0, 1, model="blob"), load_file(str(v1 / "model.safetensors")))
            assert client.fetch(0, 2, model="local")
            seaweed.upload_dir(v2, bucket, "blob/")
            admin.reload("blob")
            _same(client.fetch(0, 1, model="blob"), load_file(str(v2 / "model.safetensors")))
        admin.close()
