"""OpenSSF Model Signing signatures, made by the real ``model_signing`` tool, as trust
roots: a signed checkpoint verifies and is served; every way the directory or the
signature can differ from what was signed is refused before serving, in one line
naming the file or the reason.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_daemon, weightd_command
from tests.trust.oms_signing import (
    ec_keypair,
    make_ca,
    model_signing,
    sign_certificate,
    sign_key,
)
from weightd.client import WeightClient
from weightd.server.base.errors import (
    DigestMismatchError,
    ManifestMismatchError,
    SignatureSyntaxError,
    UnsupportedSignatureError,
    UntrustedKeyError,
)
from weightd.server.trust import oms
from weightd.server.trust.verify import Verification, VerifyOptions, verify_checkpoint

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def signed(
    transformers_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, Path]:
    """(model directory with a tokenizer file weightd does not read, its signature,
    the public key), signed once by ``model_signing sign key``."""
    root = tmp_path_factory.mktemp("oms")
    model = root / "llama"
    shutil.copytree(transformers_models["llama"], model)
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    private, public = ec_keypair(root / "keys")
    return model, sign_key(model, private, root / "model.sig"), public


def _copy(signed: tuple[Path, Path, Path], tmp_path: Path) -> Path:
    model = tmp_path / "llama"
    shutil.copytree(signed[0], model)
    return model


def _verify(
    model: Path, signature: Path, keys: tuple[Path, ...] = (), chains: tuple[Path, ...] = ()
) -> Verification:
    v = verify_checkpoint(
        str(model),
        None,
        VerifyOptions(
            signatures={"": str(signature)},
            trust_keys=tuple(map(str, keys)),
            trust_chains=tuple(map(str, chains)),
            progress=False,
        ),
    )
    v.store.close()
    return v


def _only(v: Verification) -> str:
    assert not v.ok and len(v.problems) >= 1, v.problems
    line = str(v.problems[0])
    assert "\n" not in line
    return line


def test_library_ignores_what_weightd_ignores(tmp_path: Path) -> None:
    """The files the library's own hashing leaves out are the ones weightd's ignore
    rules leave out (its default git paths and a statement's ignore list)."""
    import model_signing

    for name in (
        "a.bin",
        ".gitattributes",
        ".gitignore",
        ".git/HEAD",
        ".github/x",
        "skip/y",
        "b/c",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    manifest = model_signing.hashing.Config().set_ignored_paths(paths=["skip"]).hash(tmp_path)
    hashed = {str(rd.identifier) for rd in manifest.resource_descriptors()}
    statement = oms.OmsStatement("s", "k", "oms-key:x", "m", {}, (*oms.GIT_PATHS, "skip"))
    present = oms.directory_files(str(tmp_path))
    assert {n for n in present if not statement.ignored(n)} == hashed == {"a.bin", "b/c"}


def test_signed_checkpoint_verifies_with_every_file_digest(signed: tuple[Path, Path, Path]) -> None:
    model, signature, public = signed
    v = _verify(model, signature, (public,))
    assert v.ok, [str(p) for p in v.problems]
    assert v.trust_root.startswith("oms-key:sha256:")
    # Every file of the directory is pinned, the tokenizer weightd does not read too.
    assert set(v.signed_files) == {p.name for p in model.iterdir()}
    import hashlib

    for name, digest in v.signed_files.items():
        assert digest == hashlib.sha256((model / name).read_bytes()).hexdigest()


def test_weightd_verify_says_what_was_proven(signed: tuple[Path, Path, Path]) -> None:
    model, signature, public = signed
    done = subprocess.run(
        weightd_command(
            "verify", str(model), "--signature", str(signature), "--trust-key", str(public)
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "OK: every check holds" in out
    assert f"OMS signature {signature}: EC key sha256:" in out
    assert "tokenizer.json" in out and "config.json" in out
    assert "16 files" in out or "files (sha256, 'files' method)" in out


@pytest.mark.parametrize(
    "change, names",
    [
        ("byte-shard", "model-00001-of-00012.safetensors"),
        ("byte-unread", "tokenizer.json"),
        ("extra", "extra.bin"),
        ("missing", "tokenizer.json"),
        ("renamed", "tokenizer.json"),
    ],
)
def test_a_changed_directory_is_refused_naming_the_file(
    signed: tuple[Path, Path, Path], tmp_path: Path, change: str, names: str
) -> None:
    _, signature, public = signed
    model = _copy(signed, tmp_path)
    if change == "byte-shard":
        shard = model / names
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0x01  # inside the last tensor's bytes
        shard.write_bytes(bytes(data))
    elif change == "byte-unread":
        (model / names).write_text('{"version": "1.1"}')
    elif change == "extra":
        (model / names).write_bytes(b"x")
    elif change == "missing":
        (model / names).unlink()
    else:
        (model / names).rename(model / "tokenizer2.json")
    v = _verify(model, signature, (public,))
    line = _only(v)
    assert names in line, line
    expected = DigestMismatchError if change.startswith("byte") else ManifestMismatchError
    assert isinstance(v.problems[0], expected), line
    if change == "renamed":
        assert any("tokenizer2.json" in str(p) for p in v.problems)


def test_signature_from_another_key_is_refused(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    model, signature, _ = signed
    _, other = ec_keypair(tmp_path, "other")
    v = _verify(model, signature, (other,))
    assert isinstance(v.problems[0], UntrustedKeyError)
    assert "not one of the 1 EC --trust-key" in _only(v)


def test_signature_over_another_model_is_refused(
    signed: tuple[Path, Path, Path], transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    _, _, public = signed
    private = public.with_suffix(".pem")
    other_sig = sign_key(transformers_models["qwen2"], private, tmp_path / "qwen2.sig")
    model = _copy(signed, tmp_path)
    v = _verify(model, other_sig, (public,))
    line = _only(v)
    assert "OMS signature" in line and ("tokenizer.json" in line or "sha256" in line), line


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "payload", "sigstore"])
def test_a_damaged_bundle_is_one_line(
    signed: tuple[Path, Path, Path], tmp_path: Path, damage: str
) -> None:
    model, signature, public = signed
    raw = signature.read_bytes()
    bad = tmp_path / "bad.sig"
    if damage == "truncated":
        bad.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        bad.write_bytes(b"\x00\xff" * 300)
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "payload":  # the statement changed after signing
        doc = json.loads(raw)
        statement = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
        statement["predicate"]["resources"].pop()
        doc["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
        bad.write_text(json.dumps(doc))
    else:
        doc = json.loads(raw)
        doc["verificationMaterial"] = {"certificate": {"rawBytes": "AA=="}, "tlogEntries": []}
        bad.write_text(json.dumps(doc))
    v = _verify(model, bad, (public,))
    line = _only(v)
    assert str(bad) in line
    if damage == "sigstore":
        assert isinstance(v.problems[0], UnsupportedSignatureError)
        assert "needs the network" in line
    elif damage == "payload":
        assert "does not verify" in line or "rejected" in line
    else:
        assert isinstance(v.problems[0], SignatureSyntaxError), line


def test_shards_serialization_is_refused_in_one_line(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    import model_signing

    model, _, public = signed
    sig = tmp_path / "shards.sig"
    model_signing.signing.Config().use_elliptic_key_signer(
        private_key=public.with_suffix(".pem")
    ).set_hashing_config(
        model_signing.hashing.Config().use_shard_serialization(shard_size=1 << 16)
    ).sign(model, sig)
    v = _verify(model, sig, (public,))
    line = _only(v)
    assert isinstance(v.problems[0], UnsupportedSignatureError)
    assert "'shards'" in line and "only 'files'" in line


def test_certificate_method_needs_the_ca_and_a_valid_leaf(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    model = _copy(signed, tmp_path)
    ca = make_ca(tmp_path / "pki")
    sig = sign_certificate(model, ca, tmp_path / "cert.sig")
    v = _verify(model, sig, chains=(ca.ca,))
    assert v.ok, [str(p) for p in v.problems]
    assert v.trust_root == "oms-certificate:CN=model-publisher@example.test"
    # Without the CA: no chain given at all, or another CA.
    assert "give --trust-chain" in _only(_verify(model, sig))
    stranger = make_ca(tmp_path / "stranger", cn="another CA")
    line = _only(_verify(model, sig, chains=(stranger.ca,)))
    assert "does not verify against --trust-chain" in line
    # An expired leaf, issued by the trusted CA.
    old = make_ca(tmp_path / "old", expired_leaf=True)
    old_sig = sign_certificate(model, old, tmp_path / "old.sig")
    line = _only(_verify(model, old_sig, chains=(old.ca,)))
    assert "expired on" in line and "model-publisher@example.test" in line


@pytest.fixture(scope="module")
def oms_daemon(
    signed: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    model, signature, public = signed
    tmp = tmp_path_factory.mktemp("oms-daemon")
    with run_daemon(
        tmp, [("llama", model)], ["--signature", str(signature), "--trust-key", str(public)]
    ) as daemon:
        yield daemon.target


@pytest.mark.e2e
def test_daemon_serves_a_signed_model_and_says_what_proved_it(oms_daemon: str) -> None:
    with WeightClient(oms_daemon) as client:
        d = client.describe("llama")
        assert d.trust_root.startswith("oms-key:sha256:")
        [info] = client.list_models()
        assert info.trust_root == d.trust_root
    listed = subprocess.run(
        weightd_command("list", "--target", oms_daemon), capture_output=True, text=True, timeout=60
    )
    assert f"trust {d.trust_root}" in listed.stdout, listed.stdout + listed.stderr
    described = _weightd("describe", "--target", oms_daemon, "--json")
    assert json.loads(described.stdout)["trust_root"] == d.trust_root, described.stderr


@pytest.mark.e2e
def test_daemon_refuses_a_changed_model_before_serving(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    _, signature, public = signed
    model = _copy(signed, tmp_path)
    (model / "extra.bin").write_bytes(b"x")
    done = subprocess.run(
        weightd_command(
            "serve",
            "--listen",
            f"unix://{tmp_path}/w.sock",
            "--model",
            f"llama={model}",
            "--signature",
            str(signature),
            "--trust-key",
            str(public),
        ),
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "WEIGHTD_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if "extra.bin" in line]
    assert errors and "is not in OMS signature" in errors[0], done.stderr
    assert not (tmp_path / "w.sock").exists()
    assert "hashed llama" in done.stderr  # refused after hashing: and yet nothing cached
    assert not list((tmp_path / "cache").glob("hashes/*")), "a refused model was cached"


def test_model_signing_cli_agrees(signed: tuple[Path, Path, Path]) -> None:
    """The standard tool verifies what weightd verifies (same directory, same key)."""
    model, signature, public = signed
    out = model_signing(
        "verify", "key", str(model), "--signature", str(signature), "--public_key", str(public)
    )
    assert "succeeded" in out.stdout


def _weightd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(weightd_command(*args), capture_output=True, text=True, timeout=120)


def test_weightd_manifest_writes_and_reads_the_oms_form(
    signed: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """``weightd manifest create --format oms`` writes what the standard tool verifies;
    ``weightd manifest show`` reads either form (an OMS one only verified)."""
    _, theirs, public = signed
    model = _copy(signed, tmp_path)
    ours = model / "model.sig"  # inside the directory: left out of what is signed
    done = _weightd(
        "manifest", "create", str(model), "--format", "oms",
        "--sign-key", str(public.with_suffix(".pem")), "-o", str(ours),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = model_signing(
        "verify", "key", str(model), "--signature", str(ours), "--public_key", str(public)
    )
    assert "succeeded" in out.stdout
    assert _verify(model, ours, (public,)).ok
    shown = _weightd("manifest", "show", str(theirs), "--trust-key", str(public))
    assert shown.returncode == 0, shown.stderr
    import hashlib

    digest = hashlib.sha256((model / "tokenizer.json").read_bytes()).hexdigest()
    assert f"{digest}  tokenizer.json" in shown.stdout
    assert "EC key sha256:" in shown.stdout
    unverified = _weightd("manifest", "show", str(theirs))
    assert unverified.returncode != 0
    assert "give --trust-key or --trust-chain" in unverified.stderr
    # weightd's own form, read by the same command.
    own = tmp_path / "manifest.json"
    assert _weightd("manifest", "create", str(model), "-o", str(own)).returncode == 0
    shown = _weightd("manifest", "show", str(own))
    assert shown.returncode == 0 and "config.json" in shown.stdout
    assert "signature not checked" in shown.stdout


def test_verifying_imports_no_sigstore_client_and_the_package_stays_whole() -> None:
    """Verifying loads the library's verifiers without the package's eager import of
    Sigstore's online client stack; any later ``import model_signing`` in the process
    still finds its public modules."""
    import sys

    code = (
        "import sys\n"
        "from weightd.server.trust import oms\n"
        "oms._library()\n"
        "assert 'sigstore' not in sys.modules and 'tuf' not in sys.modules, 'eager'\n"
        "import model_signing\n"
        "assert model_signing.__version__.startswith('1.')\n"
        "model_signing.signing.Config().use_elliptic_key_signer\n"
        "model_signing.hashing.Config().use_file_serialization()\n"
        "model_signing.verifying.Config\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
