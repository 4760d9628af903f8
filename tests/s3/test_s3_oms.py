"""OpenSSF Model Signing through the object store (real SeaweedFS): a model under an
``s3://`` prefix with its signature in the bucket is served, each byte hashed once on
its way in; a bucket that differs from the signature is refused before serving, nothing
kept; an adapter signed the same way loads from a local and from an ``s3://`` root.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tests.adapters.conftest import BASE_CONFIG, make_adapter
from tests.conftest import run_daemon
from tests.models import build_model
from tests.s3.conftest import SeaweedS3
from tests.s3.test_s3_models import _env, _same, _serve_fails
from tests.trust.oms_signing import ec_keypair, sign_key
from weightd.client import WeightClient
from weightd.client.api.admin import AdminClient
from weightd.client.base.errors import DigestMismatch, FailedPreconditionError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _signed_copy(local: Path, tmp: Path, private: Path) -> Path:
    """The checkpoint with its signature inside (``model.sig``, as the CLI's own ignore
    rules then leave it out) and a tokenizer file weightd does not read."""
    model = tmp / "signed"
    shutil.copytree(local, model)
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    sign_key(model, private, model / "model.sig")
    return model


def test_signed_prefix_is_served_hashed_once_and_a_changed_bucket_is_refused(
    seaweed: SeaweedS3,
    transformers_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    private, public = ec_keypair(tmp_path / "keys")
    model = _signed_copy(transformers_models["llama-gqa"], tmp_path, private)
    bucket = seaweed.bucket()
    seaweed.upload_dir(model, bucket, "llama/")
    _env(monkeypatch, seaweed)
    common = ["--s3-endpoint", seaweed.endpoint, "--trust-key", str(public)]
    extra = [*common, "--signature", f"remote=s3://{bucket}/llama/model.sig"]
    models = [("local", model), ("remote", f"s3://{bucket}/llama/")]
    with run_daemon(tmp_path, models, [*extra, "--s3-part-bytes", str(64 << 10)]) as d:
        with WeightClient(d.target, timeout=60) as client:
            _same(
                client.fetch(0, 2, model="local", transport="grpc"),
                client.fetch(0, 2, model="remote", transport="grpc"),
            )
            assert client.describe("remote").trust_root.startswith("oms-key:sha256:")
            assert client.describe("local").trust_root == ""
        log = d.log()
        # Each shard byte hashed once, on its way in (SHA-256 and BLAKE3 together).
        assert "remote: all 11 shards unchanged since hashed (hash cache)" in log, log
        assert "hashed remote" not in log
    cache = tmp_path / "cache"
    args = ["--model", "", *extra, "--log-json"]

    def refused(prefix: str) -> str:
        args[1] = f"remote=s3://{bucket}/{prefix}/"
        args[args.index("--signature") + 1] = f"remote=s3://{bucket}/llama/model.sig"
        before = set(cache.glob("sources/*/v-*"))
        done = _serve_fails(tmp_path, args)
        assert set(cache.glob("sources/*/v-*")) <= before  # nothing kept
        return done.stderr

    # One extra object under the prefix: refused from the listing, nothing downloaded.
    seaweed.upload_dir(model, bucket, "extra/")
    seaweed.client().put_object(Bucket=bucket, Key="extra/extra.bin", Body=b"x")
    err = refused("extra")
    assert f"s3://{bucket}/extra/extra.bin: is not in OMS signature" in err, err
    assert "nothing was downloaded" in err and '"phase": "start"' not in err
    # One object missing.
    seaweed.upload_dir(model, bucket, "missing/")
    seaweed.client().delete_object(Bucket=bucket, Key="missing/tokenizer.json")
    err = refused("missing")
    assert "missing/tokenizer.json: is signed by OMS signature" in err, err
    # One byte changed, same size: refused when that file is down, before serving.
    seaweed.upload_dir(model, bucket, "byte/")
    shard = "model-00001-of-00011.safetensors"
    data = bytearray((model / shard).read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 + length + 10] ^= 1
    seaweed.client().put_object(Bucket=bucket, Key=f"byte/{shard}", Body=bytes(data))
    err = refused("byte")
    assert f"s3://{bucket}/byte/{shard}: sha256 is" in err and "OMS signature" in err, err
    assert not list(cache.glob("sources/*/v-*.partial"))  # the bytes were discarded
    # A signature from another key, in the bucket: refused before anything is listed.
    other_private, _ = ec_keypair(tmp_path / "other")
    forged = tmp_path / "forged.sig"
    sign_key(model, other_private, forged)
    seaweed.client().put_object(Bucket=bucket, Key="llama/forged.sig", Body=forged.read_bytes())
    args[1] = f"remote=s3://{bucket}/llama/"
    args[args.index("--signature") + 1] = f"remote=s3://{bucket}/llama/forged.sig"
    done = _serve_fails(tmp_path, args)
    assert "not one of the 1 EC --trust-key" in done.stderr, done.stderr
    # A truncated bundle in the bucket: one line, never INTERNAL.
    raw = (model / "model.sig").read_bytes()
    seaweed.client().put_object(Bucket=bucket, Key="llama/cut.sig", Body=raw[: len(raw) // 3])
    args[args.index("--signature") + 1] = f"remote=s3://{bucket}/llama/cut.sig"
    done = _serve_fails(tmp_path, args)
    assert "cut.sig: not a Sigstore bundle" in done.stderr, done.stderr
    assert "INTERNAL" not in done.stderr and "Traceback" not in done.stderr


def test_signed_adapter_loads_from_a_local_and_an_s3_root(
    seaweed: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    private, public = ec_keypair(tmp_path / "keys")
    base_dir, root = tmp_path / "tiny-llama", tmp_path / "adapters"
    build_model("llama", BASE_CONFIG).save_pretrained(str(base_dir))
    for name, seed in (("good", 1), ("other", 2)):  # the same shapes, other weights
        make_adapter(base_dir, root / name, seed, 4)
    signature = sign_key(root / "good", private, tmp_path / "good.sig")
    bucket = seaweed.bucket()
    seaweed.upload_dir(root / "good", bucket, "adapters/good/")
    seaweed.upload_dir(root / "other", bucket, "adapters/other/")
    for key, value in seaweed.env().items():
        monkeypatch.setenv(key, value)
    s3_root = f"s3://{bucket}/adapters/"
    extra = ["--adapter-root", str(root), "--adapter-root", s3_root]
    extra += ["--s3-endpoint", seaweed.endpoint, "--trust-key", str(public)]
    for name in ("local", "remote", "swapped", "swapped-remote"):
        extra += ["--adapter-signature", f"{name}={signature}"]
    with run_daemon(tmp_path, [("tiny-llama", base_dir)], extra) as d:
        with AdminClient(f"unix://{tmp_path / 'run' / 'admin.sock'}", timeout=60) as admin:
            local = admin.load_adapter("local", str(root / "good"))
            remote = admin.load_adapter("remote", s3_root + "good/")  # no expected digest
            assert remote.digest == local.digest
            signed_by = r"adapter_model\.safetensors: sha256 is \w+, OMS signature"
            with pytest.raises(DigestMismatch, match=signed_by):
                admin.load_adapter("swapped", str(root / "other"))
            with pytest.raises(DigestMismatch, match=signed_by):
                admin.load_adapter("swapped-remote", s3_root + "other/")
            # Unsigned and not pinned: still refused from the bucket, as before.
            with pytest.raises(FailedPreconditionError, match="not a trust root"):
                admin.load_adapter("unsigned", s3_root + "other/")
        with WeightClient(d.target, timeout=60) as client:
            a = client.fetch_adapter("remote", 0, 2, transport="grpc").tensors
            b = client.fetch_adapter("local", 0, 2, transport="grpc").tensors
            assert a.keys() == b.keys() and a
            for name, tensor in a.items():
                assert torch.equal(tensor, b[name]), name
    assert not list((tmp_path / "cache").glob("sources/*/v-*/adapter_model.safetensors.*"))
    assert json.loads((root / "good" / "adapter_config.json").read_text())
