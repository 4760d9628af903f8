"""The trust commands of the CLI: ``weightd verify`` and ``weightd manifest ...`` (the
``serve`` settings that name trust sources are in the config). Kept apart from
``main.py`` so that file only registers and dispatches.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from ..base.errors import CheckpointError, UsageError, WeightdError
from ..base.words import count

if TYPE_CHECKING:  # the verify stack (blake3, cryptography) loads only when used
    from ..trust.verify import Verification

#: Problems printed by ``weightd verify`` before "... and N more" (``--json`` has all).
MAX_PRINTED_PROBLEMS: Final = 100


def _check_trust_args(args: argparse.Namespace) -> None:
    if args.trust_key and not (args.manifest or args.signature):
        raise UsageError("--trust-key needs --manifest or --signature (the key signs one)")
    if args.signature and not (args.trust_key or args.trust_chain):
        raise UsageError(
            "--signature needs --trust-key (EC public key) or --trust-chain (CA "
            "certificates): a signature proves origin only against a key or CA you name"
        )
    if args.trust_chain and not args.signature:
        raise UsageError("--trust-chain needs --signature (the CA vouches for its signer)")


# --- weightd verify --------------------------------------------------------------------


def add_parsers(sub: Any) -> None:
    v = sub.add_parser(
        "verify", help="check a checkpoint directory: structure, config, digests, trust"
    )
    v.add_argument("directory")
    v.add_argument("--manifest", default=None, help="trusted manifest the checkpoint must match")
    v.add_argument(
        "--signature",
        default=None,
        metavar="FILE",
        help="OpenSSF Model Signing signature (`model_signing sign`) the directory must match",
    )
    v.add_argument(
        "--trust-key",
        action="append",
        default=[],
        metavar="PUBKEY",
        help="public key (PEM): Ed25519 for a manifest, EC for an OMS signature",
    )
    v.add_argument(
        "--trust-chain",
        action="append",
        default=[],
        metavar="PEM",
        help="CA certificates an OMS certificate signature must chain to",
    )
    v.add_argument("--trust-hf-cache", action="store_true")
    v.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    v.add_argument("--hash-threads", type=int, default=None)

    m = sub.add_parser("manifest", help="create trusted manifests and signing keys")
    msub = m.add_subparsers(dest="manifest_command", required=True)
    c = msub.add_parser("create", help="hash a checkpoint and write its manifest")
    c.add_argument("directory")
    c.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    c.add_argument(
        "--sign-key",
        default=None,
        help="private key (PEM) to sign with: Ed25519 for weightd's form, EC for --format oms",
    )
    c.add_argument(
        "--format",
        choices=("weightd", "oms"),
        default="weightd",
        help="weightd: weightd's manifest (JSON, tensor digests); oms: an OpenSSF Model "
        "Signing signature written by the model-signing library (needs --sign-key, -o)",
    )
    c.add_argument("--hash-threads", type=int, default=None)
    s = msub.add_parser(
        "show",
        help="print what a weightd manifest or an OMS signature pins (files, digests, signer)",
    )
    s.add_argument("file")
    s.add_argument("--trust-key", action="append", default=[], metavar="PUBKEY")
    s.add_argument("--trust-chain", action="append", default=[], metavar="PEM")
    k = msub.add_parser("keygen", help="write a new Ed25519 key pair")
    k.add_argument("--out-private", required=True)
    k.add_argument("--out-public", required=True)


def _problem_record(p: WeightdError) -> dict[str, str]:
    record = {"type": type(p).__name__, "message": str(p)}
    if isinstance(p, CheckpointError):
        record["file"] = p.path
    return record


def _report_text(v: Verification, trust_given: bool) -> list[str]:
    """The human report; ``trust_given``: a manifest, key or HF cache check was asked for."""
    lines = [f"weightd verify {v.root} ({v.name})"]
    ckpt = v.checkpoint
    if ckpt is not None:
        lines.append(
            f"  structure  {count(len(ckpt.shards), 'shard')}, "
            f"{count(len(ckpt.tensors), 'tensor')}, "
            f"{ckpt.total_bytes} bytes: index and headers consistent"
        )
        lines.append(f"  config     {v.config_summary or ckpt.architecture or '(no architecture)'}")
    if v.files:
        how = f"hashed {v.hashed_bytes / (1 << 30):.2f} GiB in {v.hash_seconds:.2f}s"
        if v.hash_seconds > 0:
            how += f" ({v.hashed_bytes / v.hash_seconds / 1e9:.2f} GB/s)"
        lines.append(
            f"  digests    sha256 of {count(len(v.files), 'file')}, blake3 of "
            f"{count(len(v.tensor_digests), 'tensor')}; {how}"
        )
        for name in sorted(v.files):
            lines.append(f"             {v.files[name].sha256}  {name}")
    unread = {n: d for n, d in v.signed_files.items() if n not in v.files}
    if unread:
        lines.append(
            f"  signed     {count(len(v.signed_files), 'file')} match the OMS signature; "
            "besides those above, not read by weightd:"
        )
        lines.extend(f"             {d}  {n}" for n, d in sorted(unread.items()))
    for t in v.trust:
        lines.append(f"  trust      {t}")
    if not v.trust and trust_given:
        # What was asked for failed (a bad signature, an unreadable manifest): the problem
        # lines say why. "none given" here would read as if no trust had been asked for.
        lines.append("  trust      NOT ESTABLISHED: the trust given did not verify (see problems)")
    elif not v.trust:
        lines.append(
            "  trust      none given: digests prove the files are intact, not who made them"
        )
    lines.extend(f"  note: {n}" for n in v.notes)
    shown = v.problems[:MAX_PRINTED_PROBLEMS]
    lines.extend(f"problem: {p}" for p in shown)
    if len(v.problems) > len(shown):
        lines.append(f"problem: ... and {len(v.problems) - len(shown)} more (--json lists all)")
    if v.ok:
        lines.append("OK: every check holds")
    else:
        lines.append(f"FAILED: {len(v.problems)} problem{'s' if len(v.problems) != 1 else ''}")
    return lines


def run_verify(args: argparse.Namespace) -> int:
    from ..trust.verify import VerifyOptions, verify_checkpoint

    manifests = {"": args.manifest} if args.manifest else {}
    _check_trust_args(args)
    options = VerifyOptions(
        manifests=manifests,
        trust_keys=tuple(args.trust_key),
        signatures={"": args.signature} if args.signature else {},
        trust_chains=tuple(args.trust_chain),
        trust_hf_cache=args.trust_hf_cache,
        threads=args.hash_threads,
        progress=not args.json,
        file_sha256=True,  # the report lists every file's SHA-256
    )
    v = verify_checkpoint(args.directory, None, options)
    try:
        if args.json:
            doc = {
                "ok": v.ok,
                "model": v.name,
                "root": v.root,
                "problems": [_problem_record(p) for p in v.problems],
                "notes": v.notes,
                "trust": v.trust,
                "trust_root": v.trust_root,
                "signed_files": v.signed_files,
                "files": {n: {"size": f.size, "sha256": f.sha256} for n, f in v.files.items()},
                "tensors": v.tensor_digests,
                "hashed_bytes": v.hashed_bytes,
                "hash_seconds": round(v.hash_seconds, 3),
            }
            print(json.dumps(doc, indent=1, sort_keys=True))
        else:
            given = bool(args.manifest or args.signature or args.trust_key or args.trust_hf_cache)
            print("\n".join(_report_text(v, given)))
    finally:
        v.store.close()
    return 0 if v.ok else 1


# --- weightd manifest ------------------------------------------------------------------


def _write_output(path: str | None, text: str) -> None:
    if path is None:
        sys.stdout.write(text)
        return
    from ..base.atomicio import write_atomic

    write_atomic(path, text.encode(), mode=0o644)  # a full disk: one line, old file kept


def run_manifest(args: argparse.Namespace) -> int:
    from ..trust.manifest import build_body, dumps
    from ..trust.signing import generate_keypair, load_private_key, sign_body
    from ..trust.verify import VerifyOptions, verify_checkpoint

    if args.manifest_command == "keygen":
        kid = generate_keypair(args.out_private, args.out_public)
        print(f"wrote {args.out_private} (private, 0600) and {args.out_public}: key {kid}")
        return 0
    if args.manifest_command == "show":
        return _show(args)
    if args.format == "oms":
        return _create_oms(args)
    private = load_private_key(args.sign_key) if args.sign_key else None
    v = verify_checkpoint(
        args.directory, None, VerifyOptions(threads=args.hash_threads, file_sha256=True)
    )
    try:
        if not v.ok or v.checkpoint is None:
            return _does_not_verify(args.directory, v.problems, "manifest")
        body = build_body(v.checkpoint, v.files, v.tensor_digests)
    finally:
        v.store.close()
    document = sign_body(body, private) if private is not None else body
    _write_output(args.output, dumps(document))
    signed = f", signed by {document['signature']['key_id']}" if private is not None else ""
    print(
        f"manifest of {v.root}: {count(len(body['files']), 'file')}, "
        f"{count(len(body['tensors']), 'tensor')}"
        f"{signed} -> {args.output or 'stdout'}",
        file=sys.stderr,
    )
    return 0


def _does_not_verify(directory: str, problems: Sequence[object], what: str) -> int:
    """Each problem on a line of its own, then the one-line refusal: exit status 1."""
    for p in problems:
        print(f"weightd manifest: problem: {p}", file=sys.stderr)
    print(
        f"weightd manifest: error: {directory} does not verify "
        f"({len(problems)} problems); no {what} written",
        file=sys.stderr,
    )
    return 1


# --- the OMS form ----------------------------------------------------------------------


def _create_oms(args: argparse.Namespace) -> int:
    """``manifest create --format oms``: the directory must verify as weightd would serve
    it, then the model-signing library signs it (its own hashing, its own format), so
    what is written is exactly what ``model_signing sign key`` writes."""
    import pathlib

    from ..trust.verify import VerifyOptions, verify_checkpoint

    if not args.sign_key or not args.output:
        raise UsageError("--format oms needs --sign-key EC_PRIVATE_KEY.pem and -o SIGNATURE")
    v = verify_checkpoint(args.directory, None, VerifyOptions(threads=args.hash_threads))
    v.store.close()
    if not v.ok:
        return _does_not_verify(args.directory, v.problems, "signature")
    try:
        import model_signing
    except ImportError:
        raise UsageError(
            "--format oms needs the model-signing package (pip install '.[signing]')"
        ) from None
    model = pathlib.Path(v.root)
    out = pathlib.Path(args.output).resolve()
    inside = [out.relative_to(model)] if out.is_relative_to(model) else []
    hashing = model_signing.hashing.Config()  # type: ignore[no-untyped-call]
    config = model_signing.signing.Config()  # type: ignore[no-untyped-call]
    try:
        signer = config.use_elliptic_key_signer(private_key=pathlib.Path(args.sign_key))
        signer.set_hashing_config(hashing.set_ignored_paths(paths=inside)).sign(model, out)
    except Exception as exc:  # the library's own errors: a wrong key type, unreadable file
        raise UsageError(f"{args.sign_key}: signing failed: {exc}") from None
    print(f"OMS signature of {v.root} (key {args.sign_key}) -> {out}", file=sys.stderr)
    return 0


def _show(args: argparse.Namespace) -> int:
    """Print a weightd manifest's or an OMS signature's files and digests, and who
    signed it when a key or CA is given (an OMS signature is only read verified)."""
    from ..trust.manifest import MAX_MANIFEST_BYTES, parse_manifest
    from ..trust.oms import describe, load_signature, read_signature_file
    from ..trust.signing import check_signature
    from ..trust.verify import manifest_keys

    raw = read_signature_file(args.file)
    if b"dsseEnvelope" in raw[:MAX_MANIFEST_BYTES]:
        if not (args.trust_key or args.trust_chain):
            raise UsageError(
                f"{args.file} is an OMS signature: give --trust-key or --trust-chain "
                "(its statement means nothing until its signature verifies)"
            )
        statement = load_signature(args.file, raw, args.trust_key, args.trust_chain)
        print(describe(statement))
        print(f"  ignores  {', '.join(statement.ignore)}")
        for name, digest in sorted(statement.files.items()):
            print(f"  {digest}  {name}")
        return 0
    manifest = parse_manifest(args.file, raw[: MAX_MANIFEST_BYTES + 1])
    if args.trust_key:
        signer = check_signature(manifest, manifest_keys(args.trust_key))
        print(f"weightd manifest {args.file}, signed by {signer.key_id} ({signer.path})")
    else:
        print(f"weightd manifest {args.file} (signature not checked: no --trust-key)")
    print(f"  {count(len(manifest.tensors), 'tensor')} with their BLAKE3 digests")
    for name, entry in sorted(manifest.files.items()):
        print(f"  {entry.sha256}  {name}")
    return 0
