"""Signing with the real OpenSSF Model Signing tool (``model_signing``), for the tests.

Keys and a private CA are generated with ``cryptography`` into the test's directory;
signatures are made by the library's own CLI (``python -m model_signing sign ...``),
exactly as a user would, so the tests check weightd against what the tool writes.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.ops.pki import _ca, _name, _write


def model_signing(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the real ``model_signing`` CLI; raise with its output when it fails."""
    done = subprocess.run(
        [sys.executable, "-m", "model_signing", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise AssertionError(f"model_signing {' '.join(args)}: {done.stdout}{done.stderr}")
    return done


def _pem_private(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def ec_keypair(directory: Path, name: str = "key") -> tuple[Path, Path]:
    """An EC P-256 key pair: (private PEM, public PEM)."""
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.pem", directory / f"{name}.pub"
    private.write_bytes(_pem_private(key))
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def sign_key(model: Path, private: Path, signature: Path) -> Path:
    model_signing(
        "sign", "key", str(model), "--private_key", str(private), "--signature", str(signature)
    )
    return signature


@dataclass(frozen=True)
class SigningCa:
    ca: Path  # the CA certificate (PEM): what --trust-chain names
    leaf_cert: Path
    leaf_key: Path


def make_ca(
    directory: Path, cn: str = "weightd test CA", *, expired_leaf: bool = False
) -> SigningCa:
    """A private CA (``tests/ops/pki.py``'s) and a code-signing leaf it issued: valid
    now, or with ``expired_leaf`` valid for three minutes that ended a minute ago (after
    the CA's own start, so only its expiry is wrong)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_cert, ca_key = _ca(cn)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    start = now - datetime.timedelta(minutes=4)
    end = now - datetime.timedelta(minutes=1) if expired_leaf else now + datetime.timedelta(days=1)
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name("model-publisher@example.test"))
        .issuer_name(ca_cert.subject)
        .public_key(leaf_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = directory / "ca.crt"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pair = _write(directory / "leaf", leaf, leaf_key)
    return SigningCa(ca_path, pair.cert, pair.key)


def sign_certificate(model: Path, ca: SigningCa, signature: Path) -> Path:
    model_signing(
        "sign",
        "certificate",
        str(model),
        "--private_key",
        str(ca.leaf_key),
        "--signing_certificate",
        str(ca.leaf_cert),
        "--certificate_chain",
        str(ca.ca),
        "--signature",
        str(signature),
    )
    return signature
