"""Manifests: canonical form, signing round trip, tampering, and the trust options."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.trust import craft
from tests.trust.corpus import manifest_of
from weightd.server.base.errors import BadSignatureError, KeyFileError, UntrustedKeyError
from weightd.server.trust.manifest import canonical_bytes, dumps, parse_manifest, signed_bytes
from weightd.server.trust.signing import (
    check_signature,
    generate_keypair,
    key_id,
    load_private_key,
    load_public_key,
    sign_body,
)
from weightd.server.trust.verify import VerifyOptions


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    generate_keypair(str(tmp_path / "k"), str(tmp_path / "k.pub"))
    return tmp_path / "k", tmp_path / "k.pub"


def test_canonical_form_ignores_key_order_and_whitespace() -> None:
    a = {"b": [1, {"y": "é", "x": 2}], "a": "\u2028"}
    b = json.loads(json.dumps(a, indent=3, ensure_ascii=False))
    assert (
        canonical_bytes(a)
        == canonical_bytes(b)
        == (b'{"a":"\\u2028","b":[1,{"x":2,"y":"\\u00e9"}]}')
    )
    assert signed_bytes(a).startswith(b"weightd-manifest-v1\x00")


def test_signed_manifest_survives_reformatting(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    d = craft.write_checkpoint(tmp_path / "m")
    doc = sign_body(manifest_of(d), load_private_key(str(keys[0])))
    for text in (dumps(doc), json.dumps(doc), json.dumps(doc, indent=7, sort_keys=False)):
        m = parse_manifest(str(tmp_path / "x.json"), text.encode())
        signer = check_signature(m, [load_public_key(str(keys[1]))])
        assert signer.key_id == doc["signature"]["key_id"]


@pytest.mark.parametrize(
    "tamper",
    [
        lambda d: d["tensors"]["model.norm.weight"].update(shape=[5]),
        lambda d: d["files"].pop("config.json"),
        lambda d: d.update(tensor_digest="blake3"),  # unchanged value: must still verify
    ],
)
def test_any_change_breaks_the_signature(
    tmp_path: Path, keys: tuple[Path, Path], tamper: object
) -> None:
    d = craft.write_checkpoint(tmp_path / "m")
    doc = sign_body(manifest_of(d), load_private_key(str(keys[0])))
    before = canonical_bytes(doc)
    tamper(doc)  # type: ignore[operator]
    m = parse_manifest("/m.json", json.dumps(doc).encode())
    trusted = [load_public_key(str(keys[1]))]
    if canonical_bytes(doc) == before:
        check_signature(m, trusted)
    else:
        with pytest.raises(BadSignatureError):
            check_signature(m, trusted)


def test_keys(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        generate_keypair(str(keys[0]), str(tmp_path / "other.pub"))
    with pytest.raises(KeyFileError, match="cannot read"):
        load_public_key(str(tmp_path / "missing.pub"))
    with pytest.raises(KeyFileError, match="not an unencrypted PEM"):
        load_private_key(str(keys[1]))
    os.mkfifo(tmp_path / "fifo.pub")
    with pytest.raises(KeyFileError, match="not a regular file"):
        load_public_key(str(tmp_path / "fifo.pub"))
    # OpenSSH public key lines are accepted and identify the same key
    from cryptography.hazmat.primitives import serialization

    pub = load_public_key(str(keys[1]))
    ssh = pub.key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    (tmp_path / "k.ssh").write_bytes(ssh + b" comment\n")
    assert load_public_key(str(tmp_path / "k.ssh")).key_id == pub.key_id == key_id(pub.key)


def test_a_matching_key_id_is_not_trust(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """A manifest claiming a trusted key's id but signed by another key is refused."""
    d = craft.write_checkpoint(tmp_path / "m")
    generate_keypair(str(tmp_path / "evil"), str(tmp_path / "evil.pub"))
    doc = sign_body(manifest_of(d), load_private_key(str(tmp_path / "evil")))
    trusted = load_public_key(str(keys[1]))
    doc["signature"]["key_id"] = trusted.key_id
    m = parse_manifest("/m.json", json.dumps(doc).encode())
    with pytest.raises(BadSignatureError):
        check_signature(m, [trusted])
    doc["signature"]["key_id"] = "ed25519:0000000000000000"
    with pytest.raises(UntrustedKeyError):
        check_signature(parse_manifest("/m.json", json.dumps(doc).encode()), [trusted])


def test_serve_manifest_options(tmp_path: Path) -> None:
    from weightd.server.base.errors import UsageError
    from weightd.server.cli.main import _parser
    from weightd.server.cli.serve_options import given_flags
    from weightd.server.config.build import verify_options
    from weightd.server.config.load import check, load

    def opts(*argv: str, names: tuple[str, ...] = ("a",)) -> VerifyOptions:
        args = _parser().parse_args(["serve", "--cache-dir", str(tmp_path), *argv])
        loaded = load(given_flags(args), {})
        check(loaded, list(names))
        return verify_options(loaded.config)

    o = opts("--manifest", "/m.json", "--trust-key", "/k.pub")
    assert o.manifest_for("a") == "/m.json" and o.trust_keys == ("/k.pub",)
    assert o.hash_cache_dir == str(tmp_path / "hashes")
    o = opts("--manifest", "b=/b.json", names=("a", "b"))
    assert o.manifest_for("b") == "/b.json" and o.manifest_for("a") is None
    with pytest.raises(UsageError, match="--trust-key: needs a manifest"):
        opts("--trust-key", "/k.pub")
    with pytest.raises(UsageError, match="name the model"):
        opts("--manifest", "/m.json", names=("a", "b"))
    with pytest.raises(UsageError, match="no model named 'c'"):
        opts("--manifest", "c=/m.json", names=("a", "b"))
    assert opts("--no-hash-cache").hash_cache_dir is None
