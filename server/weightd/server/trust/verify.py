"""Verifying a checkpoint end to end: structure, config, digests, trust. The I/O side.

One function, :func:`verify_checkpoint`, serves both ``weightd serve`` (which
publishes only when the problem list is empty) and ``weightd verify`` (which prints
it). It goes as far as it usefully can and collects every problem on the way:

1. trust sources: the manifest is parsed and its signature checked before anything
   is hashed (a bad signature makes hashing pointless); an OpenSSF Model Signing
   signature is verified on a thread beside steps 2-4 (:class:`~.oms.PendingSignature`)
   and waited for before step 5;
2. structure: index, every shard header, cross-checks (see :mod:`weightd.server.checkpoint.scan`);
3. config: parameter names, shapes and dtypes (see :mod:`weightd.server.checkpoint.config_check`);
4. digests: one pass per shard for SHA-256 and per-tensor BLAKE3 (or the hash
   cache, when the shard's fstat key is unchanged);
5. comparison with the manifest, the OMS signature (:func:`~.oms.compare_directory`)
   and/or the Hugging Face cache blob names.

Digests are computed only for a structurally sound checkpoint; the report says so
when they were skipped.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..base.cleanup import closing
from ..base.errors import CheckpointError, KeyFileError, ManifestSyntaxError, WeightdError
from ..base.readfile import ReadRefused, read_bounded
from ..base.words import count
from ..checkpoint.config_check import check_layout
from ..checkpoint.description import Checkpoint
from ..checkpoint.scan import Scan, scan_checkpoint
from ..store.shards import ShardStore
from ..telemetry.progress import Reporter
from .hashcache import CacheEntry, HashCache
from .hashing import Progress, ShardDigests, ShardJob, TensorRange, hash_shards
from .hfcache import (
    HashedFile,
    Snapshot,
    blob_kind,
    check_link,
    compare_blobs,
    open_snapshot,
    snapshot_of,
)
from .manifest import MAX_MANIFEST_BYTES, FileDigest, Manifest, compare, parse_manifest
from .oms import OmsStatement, PendingSignature, compare_directory, describe, is_ec_key
from .signing import TrustedKey, check_signature, load_public_key

log = logging.getLogger("weightd.verify")


@dataclass(frozen=True)
class VerifyOptions:
    """How a checkpoint is verified and what it must be traceable to."""

    #: Manifest per model name ("" applies to any model without its own).
    manifests: Mapping[str, str] = field(default_factory=dict)
    #: Public keys (files) a manifest must be signed by; empty: signatures not required.
    #: EC keys among them check OMS signatures, Ed25519 ones weightd manifests.
    trust_keys: tuple[str, ...] = ()
    #: OMS signature (``model_signing sign``) per model name ("" as for manifests).
    signatures: Mapping[str, str] = field(default_factory=dict)
    #: OMS signature per adapter name (exact names only).
    adapter_signatures: Mapping[str, str] = field(default_factory=dict)
    #: CA certificates (PEM files) an OMS ``certificate`` signature must chain to.
    trust_chains: tuple[str, ...] = ()
    #: Require the checkpoint to be a Hugging Face cache snapshot whose blob names match.
    trust_hf_cache: bool = False
    #: Directory of the hash cache; None: no cache.
    hash_cache_dir: str | None = None
    #: Hash every shard even when the cache has it.
    reverify: bool = False
    #: Shards hashed at once (None: one per core).
    threads: int | None = None
    #: Report hashing progress (a bar on a terminal, log lines otherwise).
    progress: bool = True
    #: Compute each shard's SHA-256. None: only when a manifest or the cache blob
    #: names will be compared with it (serving itself needs the per-tensor BLAKE3 only).
    file_sha256: bool | None = None
    #: Hash at all. False: every check but the digests (trust files, structure, layout),
    #: which ``weightd serve`` runs before its first log line; the digests come after.
    digests: bool = True
    #: Once set, hashing stops within a block (:class:`~.hashing.HashingStopped`): the
    #: daemon sets it when a signal stops start-up, whose loads run on threads of their
    #: own that the signal does not reach.
    cancel: threading.Event | None = field(default=None, compare=False)
    #: The trust root reported when no source above proved the version (a remote one
    #: served with ``--trust-object-store``: "object-store").
    fallback_root: str = ""

    def manifest_for(self, name: str) -> str | None:
        return self.manifests.get(name) or self.manifests.get("")

    def signature_for(self, name: str) -> str | None:
        return self.signatures.get(name) or self.signatures.get("")


@dataclass
class Verification:
    """What verifying found. ``ok`` only when there is a checkpoint and no problem."""

    root: str
    name: str
    store: ShardStore
    checkpoint: Checkpoint | None
    problems: list[WeightdError]
    notes: list[str] = field(default_factory=list)
    files: dict[str, FileDigest] = field(default_factory=dict)
    tensor_digests: dict[str, str] = field(default_factory=dict)
    cached_shards: list[str] = field(default_factory=list)
    hashed_bytes: int = 0
    hash_seconds: float = 0.0
    trust: list[str] = field(default_factory=list)  # what the checkpoint was checked against
    #: The trust root that proved the version, short (DescribeModel, metrics, list):
    #: "oms-key:sha256:...", "oms-certificate:CN=...", "manifest:ed25519:...",
    #: "manifest-unsigned", "hf-cache", "" (only the digests computed at load).
    trust_root: str = ""
    #: Every file an OMS signature pins, with the SHA-256 it was found to have.
    signed_files: dict[str, str] = field(default_factory=dict)
    #: Records what was hashed in the hash cache; called only when everything holds.
    cache_write: Callable[[], None] | None = None
    config_summary: str = ""  # what the config check covered

    @property
    def ok(self) -> bool:
        return self.checkpoint is not None and not self.problems


def first_problem(problems: list[WeightdError], model_dir: str) -> WeightdError:
    """The first problem, its message saying how many more ``weightd verify`` would list."""
    if not problems:
        return CheckpointError(model_dir, "verification failed without a reported problem")
    first = problems[0]
    if len(problems) > 1 and "more problem" not in first.message:
        first.message += f" (and {len(problems) - 1} more problems: weightd verify {model_dir})"
    return first


def read_operator_file(path: str, limit: int, error: type[CheckpointError]) -> bytes:
    """Read a file the operator named (a manifest): regular, bounded, never a FIFO."""
    try:
        return read_bounded(path, limit)
    except ReadRefused as exc:
        raise error(path, exc.reason) from None


def manifest_keys(paths: Sequence[str]) -> list[TrustedKey]:
    """The Ed25519 keys among ``--trust-key`` (the EC ones are for OMS signatures)."""
    return [load_public_key(k) for k in paths if not is_ec_key(k)]


@dataclass
class _Trust:
    """The trust sources, loaded and checked before anything is hashed."""

    manifest: Manifest | None = None
    snapshot: Snapshot | None = None
    oms: OmsStatement | None = None
    ok: bool = True


def _prepare_trust(v: Verification, options: VerifyOptions) -> _Trust:
    """Load the manifest (signature checked), the OMS signature (verified) and the
    snapshot. ``ok`` False: trust failed."""
    manifest_path = options.manifest_for(v.name)
    t = _Trust()
    try:
        keys = manifest_keys(options.trust_keys) if manifest_path is not None else []
        if manifest_path is not None:
            raw = read_operator_file(manifest_path, MAX_MANIFEST_BYTES, ManifestSyntaxError)
            t.manifest = parse_manifest(manifest_path, raw)
            if keys:
                signer = check_signature(t.manifest, keys)
                v.trust.append(
                    f"manifest {manifest_path}, signed by {signer.key_id} ({signer.path})"
                )
                v.trust_root = f"manifest:{signer.key_id}"
            elif options.trust_keys:
                raise KeyFileError(
                    options.trust_keys[0],
                    "no --trust-key is an Ed25519 key, which a weightd manifest is signed with",
                )
            else:
                v.trust.append(f"manifest {manifest_path} (signature not checked: no --trust-key)")
                v.notes.append(
                    "the manifest's signature was not checked: it proves integrity, not origin"
                )
                v.trust_root = "manifest-unsigned"
        if options.trust_hf_cache:
            t.snapshot = snapshot_of(v.root)
            v.trust.append(f"Hugging Face cache blobs of {t.snapshot.repo} @ {t.snapshot.revision}")
            v.trust_root = v.trust_root or "hf-cache"
    except CheckpointError as exc:
        v.problems.append(exc)
        t.ok = False
    return t


def verify_checkpoint(
    model_dir: str, name: str | None = None, options: VerifyOptions | None = None
) -> Verification:
    """Check everything that can be checked; the caller owns (and closes) ``store``.

    Never raises a WeightdError: every problem is in ``problems``.
    """
    options = options or VerifyOptions()
    root = os.path.realpath(model_dir)
    model_name = name or os.path.basename(root)
    placeholder = ShardStore(root)
    v = Verification(root, model_name, placeholder, None, [])
    signature = options.signature_for(model_name)
    pending = (
        PendingSignature(signature, options.trust_keys, options.trust_chains)
        if signature is not None
        else None
    )
    try:
        _verify(v, model_dir, options, pending)
    finally:
        if pending is not None and not pending.settled:  # an early return: still reported
            _settle(v, pending)
    return v


def _settle(v: Verification, pending: PendingSignature) -> OmsStatement | None:
    """The OMS signature's outcome into ``v``: its trust line, or its problem."""
    got = pending.result()
    if isinstance(got, WeightdError):
        v.problems.append(got)
        return None
    v.trust.append(describe(got))
    v.trust_root = got.root
    return got


def _verify(
    v: Verification, model_dir: str, options: VerifyOptions, pending: PendingSignature | None
) -> None:
    """:func:`verify_checkpoint`'s steps, with ``pending`` verifying meanwhile."""
    root, model_name = v.root, v.name
    t = _prepare_trust(v, options)
    manifest, snapshot, trusted = t.manifest, t.snapshot, t.ok
    directory = None
    if snapshot is not None:
        try:
            directory = open_snapshot(snapshot)
        except CheckpointError as exc:
            v.problems.append(exc)
            v.notes.append("digests not computed: fix the problems above first")
            return
    scan = scan_checkpoint(model_dir, model_name, directory=directory)
    # Where the descriptor the files were read by points (model_dir may be a link that
    # an operator flipped since ``root`` was resolved above).
    root = v.root = scan.root
    v.store = scan.store
    v.problems.extend(scan.problems)
    if scan.config is not None and scan.checkpoint is not None:
        layout = check_layout(root, scan.config, scan.checkpoint.tensors)
        v.problems.extend(layout.problems)
        v.notes.extend(layout.notes)
        if layout.layout is not None:
            v.config_summary = (
                f"{layout.layout.architecture} ({layout.layout.family} family): tensor names, "
                f"shapes and dtypes checked against config.json"
            )
    if snapshot is not None:
        v.problems.extend(_check_links(snapshot, scan))
    ckpt = scan.checkpoint
    if ckpt is None or v.problems or not trusted:
        v.notes.append("digests not computed: fix the problems above first")
        return
    if not options.digests:
        v.notes.append("digests not computed: structure only, as asked")
        return
    need_sha256 = options.file_sha256
    if need_sha256 is None:
        need_sha256 = manifest is not None or snapshot is not None or pending is not None
    try:
        shard_digests = _digests(v, ckpt, scan.store, options, snapshot is not None, need_sha256)
    except WeightdError as exc:  # a shard changed or shrank while it was read
        v.problems.append(exc)
        return
    for shard, d in shard_digests.items():
        if d.sha256:
            v.files[shard] = FileDigest(d.size, d.sha256)
        v.tensor_digests.update(d.tensors)
    for small in ckpt.small_files.values():
        v.files[small.name] = FileDigest(small.size, small.sha256)
    if manifest is not None:
        v.problems.extend(compare(manifest, ckpt, v.files, v.tensor_digests))
    if pending is not None:
        statement = _settle(v, pending)
        if statement is not None:
            v.problems.extend(compare_directory(statement, root, v.files, v.signed_files))
    if snapshot is not None:
        hashed = {
            s: HashedFile(scan.store.shard(s).real_path, d.sha256, d.git_sha1)
            for s, d in shard_digests.items()
        }
        for small in ckpt.small_files.values():
            hashed[small.name] = HashedFile(small.real_path, small.sha256, small.git_sha1)
        v.problems.extend(compare_blobs(root, hashed))
    if v.problems:
        v.checkpoint = None
    else:
        v.checkpoint = ckpt
        v.trust_root = v.trust_root or options.fallback_root
        if v.cache_write is not None:
            v.cache_write()


def _check_links(snapshot: Snapshot, scan: Scan) -> list[WeightdError]:
    problems: list[WeightdError] = []
    for small in scan.small_files.values():
        p = check_link(snapshot, scan.root, small.name, small.real_path, small.linked)
        if p is not None:
            problems.append(p)
    for name, shard in scan.store.shards.items():
        p = check_link(snapshot, scan.root, name, shard.real_path, shard.linked)
        if p is not None:
            problems.append(p)
    return problems


def _digests(
    v: Verification,
    ckpt: Checkpoint,
    store: ShardStore,
    options: VerifyOptions,
    need_git_sha1: bool,
    need_sha256: bool,
) -> dict[str, ShardDigests]:
    """Every shard's digests, from the cache where its key still matches, else hashed."""
    ranges: dict[str, list[TensorRange]] = {s: [] for s in ckpt.shards}
    for t in ckpt.tensors.values():
        ranges[t.shard].append(TensorRange(t.name, t.offset, t.nbytes))
    cache = (
        HashCache(options.hash_cache_dir, ckpt.root) if options.hash_cache_dir is not None else None
    )
    out: dict[str, ShardDigests] = {}
    jobs: list[ShardJob] = []
    for shard in ckpt.shards:
        opened = store.shard(shard)
        rs = tuple(sorted(ranges[shard], key=lambda r: r.offset))
        git = need_git_sha1 and blob_kind(opened.real_path) == "git_sha1"
        if cache is not None and not options.reverify:
            hit = cache.lookup(shard, opened.real_path, opened.identity, rs, git, need_sha256)
            if hit is not None:
                out[shard] = hit
                v.cached_shards.append(shard)
                continue
        jobs.append(
            ShardJob(
                shard,
                opened.path,
                opened.fd,
                opened.identity.size,
                rs,
                git_sha1=git,
                sha256=need_sha256,
                check=functools.partial(store.check_identical, shard),
            )
        )
    total = sum(j.size for j in jobs)
    reporter = Reporter(f"hashing {ckpt.name}") if options.progress and total else None
    progress = Progress(total, reporter.advance if reporter else None)
    started = time.monotonic()
    with closing(reporter.close if reporter else lambda: None, "the progress line"):
        hashed = hash_shards(jobs, options.threads, progress, cancel=options.cancel)
    v.hash_seconds = time.monotonic() - started
    v.hashed_bytes = total
    out.update(hashed)
    if cache is not None and hashed:
        # Written once the whole verification holds (_verify): a refused checkpoint
        # leaves nothing in the cache.
        entries = {
            # The identity at open, which the pass proved unchanged after reading
            # (a fresh fstat here could pair a newer file with older digests).
            shard: CacheEntry(
                store.shard(shard).real_path,
                store.shard(shard).identity,
                tuple(sorted(ranges[shard], key=lambda r: r.offset)),
                d,
            )
            for shard, d in hashed.items()
        }
        v.cache_write = functools.partial(cache.update, entries)
    if jobs:
        log.info(
            "hashed %s: %s, %.2f GiB in %.2fs (%.2f GB/s, %s)%s",
            ckpt.name,
            count(len(jobs), "shard"),
            total / (1 << 30),
            v.hash_seconds,
            total / v.hash_seconds / 1e9 if v.hash_seconds > 0 else 0.0,
            "file SHA-256 and tensor BLAKE3" if need_sha256 else "tensor BLAKE3",
            f"; {len(v.cached_shards)} from the hash cache" if v.cached_shards else "",
        )
    elif v.cached_shards:
        log.info(
            "%s: %s unchanged since hashed (hash cache)",
            ckpt.name,
            "the shard" if len(out) == 1 else f"all {len(out)} shards",
        )
    return {s: out[s] for s in ckpt.shards}
