"""OpenSSF Model Signing (OMS) signatures as trust roots: what the signature proves.

An OMS signature (``model_signing sign key|certificate DIR --signature model.sig``) is
a Sigstore bundle holding a DSSE envelope over an in-toto statement that lists every
file of the model directory with its SHA-256. weightd does not re-implement that
format: the ``model-signing`` package (the ``weightd[signing]`` extra) parses the
bundle and checks the envelope's signature, and its verifier returns the *expected*
manifest. What weightd adds is where the bytes come from: instead of letting the
library hash the directory a second time, the expected digests are compared with the
file SHA-256s that weightd's own pass computes next to the per-tensor BLAKE3
(:func:`compare_directory`, :mod:`weightd.server.trust.verify`), and with the digests
an ``s3://`` download computes as the bytes arrive (:mod:`weightd.server.sources`).

The bundle is untrusted input until its signature verifies: it is read bounded, and
whatever the library raises on garbage becomes one :class:`SignatureSyntaxError` line.
Only the ``files`` serialization with SHA-256 is accepted; ``shards`` (pieces of files,
each digested) would need a second, piecewise hash of every file, which is what this
module exists to avoid, so it is refused in one line that says how to sign instead.
The ``sigstore`` method (Fulcio certificates, Rekor log) needs the network and is
refused here too.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

from ..base.errors import (
    BadSignatureError,
    DigestMismatchError,
    KeyFileError,
    ManifestMismatchError,
    PathEscapeError,
    SignatureError,
    SignatureSyntaxError,
    UnsupportedSignatureError,
    UntrustedKeyError,
    WeightdError,
    echo,
)
from ..base.paths import check_relative_name, open_confined
from ..base.readfile import ReadRefused, read_bounded
from .manifest import FileDigest

#: Largest signature file read (a statement lists one name and digest per file: a
#: directory of 100k files is ~15 MiB of JSON).
MAX_SIGNATURE_BYTES: Final = 16 << 20
#: Largest certificate chain file read.
MAX_CHAIN_BYTES: Final = 1 << 20
#: Largest number of files a statement may list, and a directory walk may meet.
MAX_FILES: Final = 100_000
#: What the library ignores when it verifies, besides the statement's own list
#: (``hashing.Config``'s default: git's files; kept equal to it by a test).
GIT_PATHS: Final = (".git", ".gitattributes", ".github", ".gitignore")
_READ_CHUNK: Final = 1 << 20


@dataclass(frozen=True)
class OmsStatement:
    """A verified OMS signature: who signed, and the files it pins."""

    origin: str  # the signature as configured: a path or an s3:// URI
    signer: str  # "EC key sha256:..." or "certificate CN=..., issued by CN=..."
    root: str  # short form for DescribeModel and metrics: "oms-key:..." / "oms-certificate:..."
    model_name: str  # the directory name at signing (informative only)
    #: Relative ``/``-separated file name -> SHA-256 hex, for every signed file.
    files: Mapping[str, str]
    #: Paths (relative) the statement and the library's defaults exclude.
    ignore: tuple[str, ...]

    def ignored(self, name: str) -> bool:
        """Whether ``name`` is outside the signature by its ignore rules (the library's
        ``should_ignore``: a path or any of its parent directories listed)."""
        should_ignore = _library().serialization.should_ignore
        # Relative paths: compared as paths, never touched on disk.
        return bool(should_ignore(pathlib.Path(name), [pathlib.Path(p) for p in self.ignore]))


@dataclass(frozen=True)
class _Library:
    """The parts of ``model-signing`` that verify (the bundle parser, the key and
    certificate verifiers, the ignore rule)."""

    sign_sigstore_pb: ModuleType
    sign_ec_key: ModuleType
    sign_certificate: ModuleType
    serialization: ModuleType


_LIBRARY: list[_Library] = []
_LIBRARY_LOCK = threading.Lock()
_PUBLIC: Final = ("hashing", "manifest", "signing", "verifying")


def _package_getattr(name: str) -> object:
    """The package's public names, imported on first use (what its ``__init__`` would
    have imported eagerly)."""
    if name in _PUBLIC:
        return importlib.import_module(f"model_signing.{name}")
    if name == "__version__":
        return importlib.metadata.version("model-signing")
    raise AttributeError(f"module 'model_signing' has no attribute {name!r}")


def _library() -> _Library:
    """The verifying modules of ``model-signing``, imported once.

    The package's ``__init__`` imports its signing side eagerly, and with it Sigstore's
    whole client stack (TUF, Rekor and Fulcio clients, an HTTP stack), which weightd
    never uses (it verifies offline) and whose import costs more CPU than the verifiers
    themselves (docs/notes/2026-12-07-oms-startup.md). Unless the package was imported
    already, it is registered without running that ``__init__``, with a module
    ``__getattr__`` that imports each public submodule on first use, so any later
    ``import model_signing`` in this process still finds ``hashing``, ``signing``, ...
    """
    with _LIBRARY_LOCK:
        if _LIBRARY:
            return _LIBRARY[0]
        if "model_signing" not in sys.modules:
            spec = importlib.util.find_spec("model_signing")
            if spec is None or spec.loader is None:
                raise ImportError("model_signing")
            package = importlib.util.module_from_spec(spec)
            package.__getattr__ = _package_getattr  # type: ignore[method-assign]
            package.__all__ = list(_PUBLIC)  # type: ignore[attr-defined]
            sys.modules["model_signing"] = package
        try:
            lib = _Library(
                importlib.import_module("model_signing._signing.sign_sigstore_pb"),
                importlib.import_module("model_signing._signing.sign_ec_key"),
                importlib.import_module("model_signing._signing.sign_certificate"),
                importlib.import_module("model_signing._serialization.serialization"),
            )
        except BaseException:  # a broken install: leave no half-registered package
            for name in [m for m in sys.modules if m.split(".")[0] == "model_signing"]:
                del sys.modules[name]
            raise
        _LIBRARY.append(lib)
        return lib


class _Text:
    """Bytes already read (bounded) handed to the library's ``Signature.read``, which
    takes a path: it only calls ``read_text``, so it never opens anything itself."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def read_text(self, encoding: str = "utf-8") -> str:
        return self._raw.decode(encoding)


def read_signature_file(path: str) -> bytes:
    """A signature file the operator named: regular, bounded, never a FIFO."""
    try:
        return read_bounded(path, MAX_SIGNATURE_BYTES)
    except ReadRefused as exc:
        raise SignatureSyntaxError(path, exc.reason) from None


def _kind(origin: str, raw: bytes) -> str:
    """``key``, ``certificate`` or ``sigstore``: which verification material the bundle
    carries (before the library parses it, to refuse what cannot be checked offline)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SignatureSyntaxError(
            origin, f"not a Sigstore bundle (not JSON: {echo(str(exc))})"
        ) from None
    material = doc.get("verificationMaterial") if isinstance(doc, dict) else None
    if not isinstance(material, dict) or not isinstance(doc.get("dsseEnvelope"), dict):
        raise SignatureSyntaxError(
            origin,
            "not an OMS signature (a Sigstore bundle with verificationMaterial and dsseEnvelope)",
        )
    if "x509CertificateChain" in material:
        return "certificate"
    if "publicKey" in material:
        return "key"
    return "sigstore"


def _parse(origin: str, raw: bytes) -> Any:
    try:
        return _library().sign_sigstore_pb.Signature.read(_Text(raw))
    except Exception as exc:  # the library raises what its parsers raise on garbage
        raise SignatureSyntaxError(
            origin, f"not a valid Sigstore bundle ({type(exc).__name__}: {echo(str(exc))[:200]})"
        ) from None


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return echo(text)[:300]


def _verify_key(origin: str, signature: Any, keys: Sequence[str]) -> tuple[Any, str, str]:
    """The manifest, the signer and its short form: the first ``--trust-key`` (EC) whose
    fingerprint the bundle names and under which the envelope verifies."""
    from cryptography.exceptions import InvalidSignature

    sign_ec_key = _library().sign_ec_key

    ec_keys = [k for k in keys if is_ec_key(k)]
    if not ec_keys:
        raise UntrustedKeyError(
            origin,
            "OMS signature made with a key, and no --trust-key is an EC public key "
            "(P-256, P-384 or P-521) it could be checked with",
        )
    hint = str(signature.bundle.verification_material.public_key.hint or "")
    for path in ec_keys:
        verifier = sign_ec_key.Verifier(pathlib.Path(path))
        try:
            manifest = verifier.verify(signature)
        except InvalidSignature:
            raise BadSignatureError(
                origin, f"the signature does not verify under {path} (changed after signing)"
            ) from None
        except ValueError as exc:
            if str(exc).startswith("Key mismatch"):
                continue
            raise BadSignatureError(origin, f"rejected under {path}: {_why(exc)}") from None
        except Exception as exc:  # a statement the library cannot read, once verified
            raise SignatureSyntaxError(origin, f"statement unreadable: {_why(exc)}") from None
        short = hint[:16] or _fingerprint(path)[:16]
        return manifest, f"EC key sha256:{short}... ({path})", f"oms-key:sha256:{short}"
    raise UntrustedKeyError(
        origin,
        f"OMS signature made by key sha256:{echo(hint[:16])}..., not one of the "
        f"{len(ec_keys)} EC --trust-key given",
    )


def _verify_certificate(
    origin: str, signature: Any, chains: Sequence[str], now: datetime.datetime
) -> tuple[Any, str, str]:
    """The manifest and the leaf's identity, once the chain verifies against the
    configured CA certificates *and* the leaf is valid now (the library checks the
    chain at the leaf's own start of validity, so an expired leaf passes it)."""
    from cryptography import x509

    sign_certificate = _library().sign_certificate

    if not chains:
        raise UntrustedKeyError(
            origin,
            "OMS signature made with a certificate: give --trust-chain with the CA "
            "certificates (PEM) that issued it",
        )
    verifier = sign_certificate.Verifier([pathlib.Path(c) for c in chains])
    try:
        manifest = verifier.verify(signature)
    except Exception as exc:  # pyOpenSSL's chain error, InvalidSignature, ValueError
        raise UntrustedKeyError(
            origin,
            f"certificate does not verify against --trust-chain: {_why(exc)}",
        ) from None
    leaf = x509.load_der_x509_certificate(
        signature.bundle.verification_material.x509_certificate_chain.certificates[0].raw_bytes
    )
    if leaf.not_valid_after_utc < now:
        raise UntrustedKeyError(
            origin,
            f"signing certificate {_plain(leaf.subject.rfc4514_string())} expired on "
            f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC",
        )
    if leaf.not_valid_before_utc > now:
        raise UntrustedKeyError(
            origin,
            f"signing certificate {_plain(leaf.subject.rfc4514_string())} is not valid before "
            f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC",
        )
    subject = _plain(leaf.subject.rfc4514_string())
    issuer = _plain(leaf.issuer.rfc4514_string())
    return manifest, f"certificate {subject}, issued by {issuer}", f"oms-certificate:{subject}"


def _plain(name: str) -> str:
    """A certificate name as it reads (``CN=...``) when it holds no control, bidi or
    other invisible character and is short; else escaped as every outside string is."""
    return name if name.isprintable() and len(name) <= 200 else echo(name)


def _fingerprint(path: str) -> str:
    try:
        return hashlib.sha256(read_bounded(path, 64 << 10)).hexdigest()
    except ReadRefused:
        return ""


def is_ec_key(path: str) -> bool:
    """Whether the key file holds an EC public key (an OMS key; weightd's own manifests
    are signed with Ed25519). Unreadable or not a key: a :class:`KeyFileError`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        data = read_bounded(path, 64 << 10)
    except ReadRefused as exc:
        raise KeyFileError(path, f"key file: {exc.reason}") from None
    if data.startswith(b"ssh-"):
        return False
    try:
        key = serialization.load_pem_public_key(data)
    except Exception as exc:
        raise KeyFileError(path, f"not a PEM public key ({_why(exc)})") from None
    return isinstance(key, ec.EllipticCurvePublicKey)


def check_chain_file(path: str) -> None:
    """A ``--trust-chain`` file: readable, bounded, at least one PEM certificate."""
    from cryptography import x509

    try:
        data = read_bounded(path, MAX_CHAIN_BYTES)
    except ReadRefused as exc:
        raise KeyFileError(path, f"certificate chain: {exc.reason}") from None
    try:
        if not x509.load_pem_x509_certificates(data):
            raise ValueError("no certificate")
    except Exception as exc:
        raise KeyFileError(path, f"not PEM certificates ({_why(exc)})") from None


def load_signature(
    origin: str,
    raw: bytes,
    keys: Sequence[str],
    chains: Sequence[str],
    now: datetime.datetime | None = None,
) -> OmsStatement:
    """Verify the bundle ``raw`` (read from ``origin``) against the configured keys or
    chains and return what it pins; raises a :class:`SignatureError` subclass."""
    if len(raw) > MAX_SIGNATURE_BYTES:
        raise SignatureSyntaxError(origin, f"larger than the {MAX_SIGNATURE_BYTES}-byte limit")
    try:
        _library()
    except ImportError:
        raise UnsupportedSignatureError(
            origin,
            "checking an OMS signature needs the model-signing package: "
            "pip install '.[signing]' from a weightd clone",
        ) from None
    kind = _kind(origin, raw)
    if kind == "sigstore":
        raise UnsupportedSignatureError(
            origin,
            "signed with the sigstore method (Fulcio certificate, Rekor log), which needs "
            "the network to verify: sign with `model_signing sign key` or `sign certificate`",
        )
    signature = _parse(origin, raw)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if kind == "key":
        manifest, signer, short = _verify_key(origin, signature, keys)
    else:
        manifest, signer, short = _verify_certificate(origin, signature, chains, now)
    return _statement(origin, manifest, signer, short)


def _statement(origin: str, manifest: Any, signer: str, short: str) -> OmsStatement:
    params = dict(manifest.serialization_type)
    method = params.get("method")
    if method != "files":
        raise UnsupportedSignatureError(
            origin,
            f"serialization method {echo(str(method))} is not supported (only 'files', "
            "what `model_signing sign` writes; 'shards' would need a second, piecewise "
            "hash of every file)",
        )
    if params.get("hash_type") != "sha256":
        raise UnsupportedSignatureError(
            origin,
            f"hash {echo(str(params.get('hash_type')))} is not supported (only sha256, "
            "the library's default)",
        )
    files: dict[str, str] = {}
    for rd in manifest.resource_descriptors():
        if len(files) >= MAX_FILES:
            raise SignatureSyntaxError(origin, f"lists more than {MAX_FILES} files")
        name = str(rd.identifier)
        check_relative_name("", name, what="signed", where=origin)
        if rd.digest.algorithm != "sha256":
            raise UnsupportedSignatureError(
                origin, f"{echo(name)}: digest algorithm {echo(rd.digest.algorithm)} (only sha256)"
            )
        files[name] = rd.digest.digest_hex
    ignore = list(GIT_PATHS)
    for p in params.get("ignore_paths", ()):
        text = str(p)
        try:
            check_relative_name("", text, what="ignored", where=origin)
        except PathEscapeError:
            continue  # outside the directory: the library skips it too
        ignore.append(text)
    return OmsStatement(
        origin=origin,
        signer=signer,
        root=short,
        model_name=echo(str(manifest.model_name)),
        files=files,
        ignore=tuple(dict.fromkeys(ignore)),
    )


def directory_files(root: str, limit: int = MAX_FILES) -> list[str]:
    """Every file under ``root`` as a relative ``/`` name, links included as names (the
    library's walk; what a link resolves to is judged when it is opened, confined)."""
    found: list[str] = []
    for top, dirs, names in os.walk(root, followlinks=False):
        rel = os.path.relpath(top, root)
        for n in names + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            found.append(n if rel == "." else f"{rel}/{n}".replace(os.sep, "/"))
            if len(found) > limit:
                raise ManifestMismatchError(root, f"holds more than {limit} files")
    return sorted(found)


def _sha256_confined(root: str, name: str) -> str:
    opened = open_confined(root, name)
    h = hashlib.sha256()
    try:
        while chunk := os.read(opened.fd, _READ_CHUNK):
            h.update(chunk)
    finally:
        os.close(opened.fd)
    return h.hexdigest()


def compare_files(
    statement: OmsStatement,
    where: str,
    present: Sequence[str],
    served: Mapping[str, str],
) -> list[WeightdError]:
    """Problems between the signed file list and ``present`` (the directory's or the
    store's names, the signature itself excluded); ``served``: the names weightd reads
    with their SHA-256 when known ("" when not yet). One problem per file."""
    problems: list[WeightdError] = []
    listed = {n for n in present if not statement.ignored(n)}
    missing = sorted(set(statement.files) - listed)
    # A renamed file is one extra and one missing: the first line names both.
    gone = f"; signed but missing: {', '.join(missing[:3])}" if missing else ""
    for name in sorted(listed - set(statement.files)):
        problems.append(
            ManifestMismatchError(
                f"{where}/{name}",
                f"is not in OMS signature {statement.origin} (an extra or renamed file{gone})",
            )
        )
    for name in missing:
        problems.append(
            ManifestMismatchError(
                f"{where}/{name}",
                f"is signed by OMS signature {statement.origin} but missing",
            )
        )
    for name in sorted(served):
        if statement.ignored(name):
            problems.append(
                ManifestMismatchError(
                    f"{where}/{name}",
                    f"is served, but OMS signature {statement.origin} ignores it "
                    f"(ignore paths: {', '.join(statement.ignore)})",
                )
            )
    return problems


def compare_directory(
    statement: OmsStatement,
    root: str,
    computed: Mapping[str, FileDigest],
    verified: dict[str, str] | None = None,
) -> list[WeightdError]:
    """Compare the signature with the directory ``root``: the file set exactly (ignore
    rules applied), and every signed file's SHA-256 from ``computed`` (weightd's own
    pass) or, for the files weightd does not read (tokenizer, README), hashed here once.
    ``verified`` receives every signed file's SHA-256 that matched.
    """
    present = [n for n in directory_files(root) if not _is_signature(root, n, statement)]
    problems = compare_files(statement, root, present, {n: d.sha256 for n, d in computed.items()})
    if problems:
        return problems
    for name, want in sorted(statement.files.items()):
        known = computed.get(name)
        try:
            got = (
                known.sha256 if known is not None and known.sha256 else _sha256_confined(root, name)
            )
        except WeightdError as exc:
            problems.append(exc)
            continue
        if got != want:
            problems.append(
                DigestMismatchError(
                    f"{root}/{name}",
                    f"sha256 is {got}, OMS signature {statement.origin} says {want}",
                )
            )
        elif verified is not None:
            verified[name] = got
    return problems


def require_signed(statement: OmsStatement, root: str, sha256: Mapping[str, str]) -> None:
    """:func:`compare_directory` for a directory read whole already (an adapter: its
    files' SHA-256 from that one read); raise the first problem, counting the rest."""
    computed = {n: FileDigest(0, d) for n, d in sha256.items()}
    problems = compare_directory(statement, root, computed)
    if problems:
        first = problems[0]
        if len(problems) > 1:
            first.message += f" (and {len(problems) - 1} more)"
        raise first


def _is_signature(root: str, name: str, statement: OmsStatement) -> bool:
    """The signature file itself, when kept inside the model directory (the library's
    CLI ignores it the same way)."""
    origin = statement.origin
    if "://" in origin:
        return False
    return os.path.realpath(os.path.join(root, name)) == os.path.realpath(origin)


class PendingSignature:
    """An OMS signature being read and verified on a thread of its own, while the
    caller scans and hashes the directory.

    Importing the library (it brings Sigstore's whole stack with it) is slow enough to
    show in a start-up next to hashing (docs/notes/2026-12-07-oms-startup.md), and it
    holds the GIL while hashing does not: side by side they overlap. Nothing depends on
    the order: the digests are only *compared* with the statement, and anything served,
    once it has verified."""

    def __init__(self, origin: str, keys: Sequence[str], chains: Sequence[str]) -> None:
        self.origin = origin
        self._keys = tuple(keys)
        self._chains = tuple(chains)
        self._statement: OmsStatement | None = None
        self._error: WeightdError | None = None
        self.settled = False
        self._thread = threading.Thread(target=self._run, name="oms-verify", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            raw = read_signature_file(self.origin)
            self._statement = load_signature(self.origin, raw, self._keys, self._chains)
        except WeightdError as exc:
            self._error = exc
        except Exception as exc:  # never INTERNAL: whatever the library raised, one line
            self._error = signature_error(self.origin, exc)

    def result(self) -> OmsStatement | WeightdError:
        """The verified statement, or the one-line reason it is not (waits for it)."""
        self._thread.join()
        self.settled = True
        if self._statement is not None:
            return self._statement
        return self._error or SignatureSyntaxError(self.origin, "verification did not finish")


def describe(statement: OmsStatement) -> str:
    """One line for ``weightd verify`` and the log: who signed and what."""
    return (
        f"OMS signature {statement.origin}: {statement.signer}; "
        f"{len(statement.files)} files (sha256, 'files' method)"
    )


def signature_error(origin: str, exc: Exception) -> SignatureError:
    """Whatever went wrong reading the signature, as one typed line."""
    if isinstance(exc, SignatureError):
        return exc
    return SignatureSyntaxError(origin, _why(exc))
