"""Ed25519 keys and manifest signatures (the ``cryptography`` package).

Why Ed25519: small keys (32 bytes), deterministic signatures (no nonce to get wrong),
fast verification, and one parameter set, so there is nothing to negotiate. Keys are
files: the private key PKCS#8 PEM (written 0600, never overwritten), the public key
SubjectPublicKeyInfo PEM; an OpenSSH ``ssh-ed25519`` public key line is accepted too.

A key id (``ed25519:`` + the first 16 hex digits of SHA-256 of the raw public key)
only says *which* trusted key to try; trust comes from the signature verifying under
a key the operator named, never from the id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..base.errors import (
    BadSignatureError,
    KeyFileError,
    OutputWriteError,
    UnsignedManifestError,
    UntrustedKeyError,
)
from ..base.readfile import ReadRefused, read_bounded
from .manifest import Manifest, signed_bytes

ALGORITHM: Final = "ed25519"
MAX_KEY_FILE_BYTES: Final = 64 << 10


@dataclass(frozen=True)
class TrustedKey:
    path: str
    key: Ed25519PublicKey
    key_id: str


def key_id(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{ALGORITHM}:{hashlib.sha256(raw).hexdigest()[:16]}"


def _read_key_file(path: str) -> bytes:
    """A key file's bytes: a regular file, bounded (a FIFO or /dev/zero is refused)."""
    try:
        return read_bounded(path, MAX_KEY_FILE_BYTES)
    except ReadRefused as exc:
        raise KeyFileError(path, f"key file: {exc.reason}") from None


def load_public_key(path: str) -> TrustedKey:
    data = _read_key_file(path)
    try:
        if data.startswith(b"ssh-"):
            key: object = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, binascii.Error, UnsupportedAlgorithm) as exc:
        raise KeyFileError(path, f"not a PEM or OpenSSH public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(path, f"public key is {type(key).__name__}, not Ed25519")
    return TrustedKey(path, key, key_id(key))


def load_private_key(path: str) -> Ed25519PrivateKey:
    data = _read_key_file(path)
    try:
        if data.startswith(b"-----BEGIN OPENSSH PRIVATE KEY"):
            key: object = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(path, f"not an unencrypted PEM or OpenSSH private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(path, f"private key is {type(key).__name__}, not Ed25519")
    return key


def _write_new(path: str, data: bytes, mode: int) -> None:
    """Create ``path`` exclusively with ``mode`` (a key is never silently replaced), whole
    or not at all (see :mod:`weightd.server.base.atomicio`)."""
    from ..base.atomicio import write_atomic

    if os.path.lexists(path):
        raise KeyFileError(path, "already exists; refusing to overwrite a key")
    try:
        write_atomic(path, data, mode=mode, exclusive=True)
    except OutputWriteError as exc:
        if "already exists" in exc.problem:
            raise KeyFileError(path, "already exists; refusing to overwrite a key") from None
        raise


def generate_keypair(private_path: str, public_path: str) -> str:
    """Write a new key pair (private 0600, public 0644); returns the key id."""
    private = Ed25519PrivateKey.generate()
    public = private.public_key()
    if os.path.lexists(public_path):
        raise KeyFileError(public_path, "already exists; refusing to overwrite a key")
    _write_new(
        private_path,
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        0o600,
    )
    try:
        _write_new(
            public_path,
            public.public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
            0o644,
        )
    except BaseException:
        os.unlink(private_path)  # no half key pair: the private key alone is useless
        raise
    return key_id(public)


def sign_body(body: Mapping[str, Any], private: Ed25519PrivateKey) -> dict[str, Any]:
    """``body`` with its ``signature`` member added."""
    value = private.sign(signed_bytes(body))
    return {
        **body,
        "signature": {
            "algorithm": ALGORITHM,
            "key_id": key_id(private.public_key()),
            "value": base64.b64encode(value).decode("ascii"),
        },
    }


def check_signature(manifest: Manifest, trusted: Sequence[TrustedKey]) -> TrustedKey:
    """The trusted key that signed ``manifest``; raises a SignatureError otherwise."""
    path = manifest.path
    sig = manifest.signature
    names = ", ".join(f"{k.key_id} ({k.path})" for k in trusted)
    if sig is None:
        raise UnsignedManifestError(
            path, f"field 'signature' is absent, but a trust key was given ({names})"
        )
    if sig.algorithm != ALGORITHM:
        raise BadSignatureError(
            path, f"field 'signature.algorithm' is {sig.algorithm!r}, only {ALGORITHM!r} is read"
        )
    matching = [k for k in trusted if k.key_id == sig.key_id]
    if not matching:
        raise UntrustedKeyError(
            path, f"field 'signature.key_id': signed by {sig.key_id[:40]!r}, trusted: {names}"
        )
    try:
        value = base64.b64decode(sig.value, validate=True)
    except (binascii.Error, ValueError):
        raise BadSignatureError(path, "field 'signature.value' is not base64") from None
    message = manifest.signed_bytes()
    for k in matching:
        try:
            k.key.verify(value, message)
        except InvalidSignature:
            continue
        return k
    raise BadSignatureError(
        path,
        f"field 'signature.value' does not verify under {sig.key_id} ({matching[0].path}): "
        "the manifest was changed after it was signed",
    )
