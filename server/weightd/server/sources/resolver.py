"""Remote sources to local directories: list, check against the trust root, download
(or find the cache warm), check every file, then hand the directory to the local loader.

The order is the trust argument:

1. the manifest (a local file, or an ``s3://`` object read into memory, bounded) is
   parsed and its signature checked against ``--trust-key`` *before* anything else;
2. the store's listing must hold every file the manifest lists, each at the manifest's
   size: a bucket modified after the manifest was made is refused here, before a
   single shard byte is downloaded, whenever the change altered a size or a file set;
3. each file, once all its ranges are on disk, must hash to the manifest's SHA-256
   before it is renamed into place (the download stops at the first file that does
   not); without a manifest (``--trust-object-store``) a plain-MD5 ETag is compared
   instead, which catches transfer and disk corruption, not tampering;
4. the complete version directory is then verified by the same pipeline as any local
   directory (structure, config, every tensor's BLAKE3, the manifest again), and only
   that makes the model servable.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TextIO

from ..base.atomicio import write_atomic
from ..base.errors import (
    CheckpointError,
    DigestMismatchError,
    ManifestMismatchError,
    ManifestSyntaxError,
    ObjectNotFound,
    ObjectTooLarge,
    ObjectTruncated,
    RemoteTrustError,
    SignatureSyntaxError,
    UsageError,
    WeightdError,
    echo,
)
from ..store.shards import FileIdentity
from ..telemetry import logs
from ..telemetry.metrics import SourceMetrics, source_failure_reason
from ..telemetry.progress import render_bar
from ..trust.hashcache import CacheEntry, HashCache
from ..trust.hashing import ShardDigests, TensorRange
from ..trust.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ..trust.oms import (
    MAX_SIGNATURE_BYTES,
    OmsStatement,
    compare_files,
    load_signature,
    read_signature_file,
)
from ..trust.signing import check_signature, load_public_key
from ..trust.verify import VerifyOptions, read_operator_file
from .cache import JOURNAL, KEEP_VERSIONS, SourceDir, fingerprint
from .download import Download, DownloadSettings
from .location import S3Location, adapter_location, is_remote, parse_s3_uri
from .s3 import RemoteObject, S3Settings, S3Store
from .tensorcheck import FileHashes, TensorChecker

log = logging.getLogger("weightd.sources")

#: Files of a model directory downloaded when no manifest lists them.
_MODEL_FILE: Final = re.compile(r"^[^/]+\.(json|safetensors)$")
#: The files an adapter directory holds (what adapters.load reads).
ADAPTER_FILES: Final = ("adapter_config.json", "adapter_model.safetensors")
_PLAIN_MD5: Final = re.compile(r'^"?([0-9a-f]{32})"?$')
#: Largest ``.json`` downloaded without a manifest pinning its size (an index of a
#: very large model is a few MiB; the local reader caps what it parses anyway).
MAX_JSON_BYTES: Final = 64 << 20
#: Seconds between two progress lines.
PROGRESS_INTERVAL_S: Final = 5.0


@dataclass(frozen=True)
class SourceOptions:
    """Everything about remote sources ``weightd serve`` was told."""

    s3: S3Settings = dataclasses.field(default_factory=S3Settings)
    download: DownloadSettings = dataclasses.field(default_factory=DownloadSettings)
    #: ``<cache-dir>/sources``: one subdirectory per source.
    cache_dir: str = ""
    #: Serve remote models without a manifest (``--trust-object-store``): whoever can
    #: write the bucket decides what is served.
    trust_object_store: bool = False


@dataclass(frozen=True)
class _Manifest:
    """A model's manifest, where it came from, and whether a ``--trust-key`` signed it."""

    manifest: Manifest
    origin: str  # as configured: a local path or an s3:// URI
    signed: bool


@dataclass(frozen=True)
class _Expected:
    """The SHA-256 each downloaded file must have, and who says so (for the message)."""

    sha256: Mapping[str, str]
    source: str  # "manifest M" / "OMS signature S"


@dataclass(frozen=True)
class Resolved:
    """A source as a local directory, and the verify options that go with it.

    A downloaded (or warm) version is not yet *serving*: the caller verifies it, then
    calls :meth:`SourceResolver.accept` once it is published (it serves: never pruned)
    or :meth:`SourceResolver.reject` (it failed: removed, nothing unverified stays).
    """

    directory: str
    options: VerifyOptions | None
    downloaded: int  # bytes fetched from the store for it (0: warm)
    #: The source's cache directory; "" for a local source (nothing to accept or reject).
    source_dir: str = ""


class _Progress:
    """``download`` progress events: bytes, rate and ETA, at most every few seconds."""

    def __init__(self, name: str, uri: str, already: int) -> None:
        self.name = name
        self.uri = uri
        self.start = time.monotonic()
        self.already = already
        self.last = 0.0
        self.stream: TextIO = sys.stderr
        self.tty = self.stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        elapsed = now - self.start
        rate = (done - self.already) / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else 0.0
        if self.tty:  # a terminal: one redrawn line, as hashing does
            bar = render_bar(f"download {self.name}", done, total, elapsed)
            self.stream.write(f"\r{bar} ETA {eta:.0f} s" + ("\n" if done >= total else ""))
            self.stream.flush()
            return
        if now - self.last < PROGRESS_INTERVAL_S and done < total:
            return
        self.last = now
        logs.event(
            "download",
            phase="progress",
            source=self.name,
            uri=self.uri,
            bytes=done,
            total=total,
            rate_mb_s=rate / 1e6,
            eta_s=eta,
        )


class SourceResolver:
    """Brings ``s3://`` sources into the cache; local directories pass through.

    One S3 client for the daemon, created on first use (so a daemon without remote
    sources never imports boto3). Thread-safe: a reload and an adapter load may resolve
    at once (each source directory has its own lock).
    """

    def __init__(
        self,
        options: SourceOptions,
        verify: VerifyOptions | None = None,
        metrics: SourceMetrics | None = None,
    ) -> None:
        self.options = options
        self.verify = verify or VerifyOptions()
        self.metrics = metrics
        self._store: S3Store | None = None
        self._lock = threading.Lock()
        #: Per source cache directory, the version each owner (a model, an adapter
        #: source) serves: only a version that passed verification is here, and no
        #: prune ever removes one of them.
        self._serving: dict[str, dict[str, str]] = {}
        self._retries_seen = 0

    def with_verify(self, verify: VerifyOptions) -> SourceResolver:
        """This resolver verifying with ``verify`` (a publish naming its own manifest);
        the cache, its locks and the directories handed out stay shared."""
        other = copy.copy(self)
        other.verify = verify
        return other

    @property
    def store(self) -> S3Store:
        with self._lock:
            if self._store is None:
                self._store = S3Store(self.options.s3)
            return self._store

    def close(self) -> None:
        """Shutdown: every request to the store in flight ends at once (typed error)."""
        with self._lock:
            store = self._store
        if store is not None:
            store.close()

    @contextlib.contextmanager
    def _accounted(self) -> Iterator[None]:
        """Every failure of a remote source counted by reason, whatever step failed (the
        listing, the manifest, a GET, a check), and the SDK's retries."""
        try:
            yield
        except Exception as exc:
            if self.metrics is not None:
                self.metrics.failures.labels(source_failure_reason(exc)).inc()
            raise
        finally:
            with self._lock:
                store = self._store
                total = store.retries.total if store is not None else self._retries_seen
                delta, self._retries_seen = total - self._retries_seen, total
            if self.metrics is not None and delta > 0:
                self.metrics.retries.inc(delta)

    # --- what serves ---------------------------------------------------------------

    def _keep(self, source_dir: str) -> set[str]:
        """The version directories that serve, of the source cached in ``source_dir``
        (real paths: a cache directory named through a link is the same directory)."""
        with self._lock:
            return set(self._serving.get(os.path.realpath(source_dir), {}).values())

    def _source_of(self, directory: str) -> str | None:
        """The source cache directory ``directory`` is a version of; None when it is not
        one of the cache's (a local model's directory: never touched)."""
        if not self.options.cache_dir:
            return None
        parent = os.path.dirname(os.path.realpath(directory))
        root = os.path.realpath(self.options.cache_dir)
        return parent if os.path.dirname(parent) == root else None

    def accept(self, owner: str, directory: str) -> None:
        """``owner`` (a model, an adapter source) now serves ``directory``: it passed
        verification and was published; never pruned while it serves. The version it
        served before may go at the next prune."""
        source_dir = self._source_of(directory)
        if source_dir is not None:
            with self._lock:
                self._serving.setdefault(source_dir, {})[owner] = os.path.realpath(directory)

    def reject(self, directory: str) -> None:
        """``directory`` failed verification (or its reload was abandoned): removed from
        the cache unless something serves it, so nothing unverified is kept."""
        source_dir = self._source_of(directory)
        if source_dir is not None and os.path.realpath(directory) not in self._keep(source_dir):
            with SourceDir.locked(source_dir):
                shutil.rmtree(directory, ignore_errors=True)

    # --- models ----------------------------------------------------------------------

    def needs_resolving(self, name: str, source: str) -> bool:
        manifest = self.verify.manifest_for(name)
        signature = self.verify.signature_for(name)
        return (
            is_remote(source)
            or (manifest is not None and is_remote(manifest))
            or (signature is not None and is_remote(signature))
        )

    def resolve_model(
        self, name: str, source: str, cancel: threading.Event | None = None
    ) -> Resolved:
        """The local directory to load model ``name`` from (``source`` itself if local).

        ``cancel``: set by the caller to end a download early (its requests end at once).
        """
        if not self.needs_resolving(name, source):
            return Resolved(source, None, 0)
        with self._accounted():
            return self._resolve_model(name, source, cancel)

    def _resolve_model(self, name: str, source: str, cancel: threading.Event | None) -> Resolved:
        found = self._manifest(name, source, cancel)
        manifest = found.manifest if found is not None else None
        oms = self.signature(name, cancel=cancel)
        options = self.verify
        if manifest is not None:
            options = dataclasses.replace(
                options, manifests={**options.manifests, name: manifest.path}
            )
        if oms is not None:
            options = dataclasses.replace(options, signatures={**options.signatures, name: oms[1]})
        if not is_remote(source):
            return Resolved(source, options, 0)
        location = parse_s3_uri(source)
        trusted = oms is not None or (
            found is not None and (found.signed or not is_remote(found.origin))
        )
        if not trusted and self.options.trust_object_store:
            options = dataclasses.replace(options, fallback_root="object-store")
        if not trusted and not self.options.trust_object_store:
            if found is not None:
                raise RemoteTrustError(
                    f"model {name!r}: manifest {found.origin} comes from the object store "
                    "and is not signed by a --trust-key, so it proves nothing the bucket does "
                    "not (whoever can rewrite a shard can rewrite it too): sign it (`weightd "
                    "manifest create --sign-key`) and give --trust-key, give a local "
                    "manifest, or --trust-object-store to serve whatever the bucket holds"
                )
            raise RemoteTrustError(
                f"model {name!r} comes from {location.uri}, and an object store is not a trust "
                f"root: give --manifest {name}=FILE (a local file, or an s3:// object signed "
                "by a --trust-key) made with `weightd manifest create`, or "
                "--trust-object-store to serve whatever the bucket holds"
            )
        if oms is not None:
            objects = self._select_signed_files(location, oms[0], cancel)
        else:
            objects = self._select_model_files(location, manifest, cancel)
        expected = (
            _Expected(oms[0].files, f"OMS signature {oms[0].origin}") if oms is not None else None
        )
        directory, fetched, source_dir = self._bring(
            name, "model", location, objects, manifest, cancel, expected
        )
        return Resolved(directory, options, fetched, source_dir)

    def signature(
        self, name: str, *, adapter: bool = False, cancel: threading.Event | None = None
    ) -> tuple[OmsStatement, str] | None:
        """The OMS signature of model (or ``adapter``) ``name``, verified against
        ``--trust-key`` / ``--trust-chain`` before anything else is read, and the local
        file it was read from (an ``s3://`` one is kept in the cache, as manifests are)."""
        if adapter:
            path = self.verify.adapter_signatures.get(name)
        else:
            path = self.verify.signature_for(name)
        if path is None:
            return None
        if is_remote(path):
            location = parse_s3_uri(path.rpartition("/")[0] + "/")
            raw = self._read_small(
                location, path.rpartition("/")[2], MAX_SIGNATURE_BYTES, cancel, SignatureSyntaxError
            )
            statement = load_signature(path, raw, self.verify.trust_keys, self.verify.trust_chains)
            cache = os.path.join(self.options.cache_dir, "manifests")
            os.makedirs(cache, mode=0o700, exist_ok=True)
            local = os.path.join(cache, hashlib.sha256(raw).hexdigest()[:32] + ".sig")
            write_atomic(local, raw, mode=0o600)
            return statement, local
        raw = read_signature_file(path)
        statement = load_signature(path, raw, self.verify.trust_keys, self.verify.trust_chains)
        return statement, path

    def _select_signed_files(
        self, location: S3Location, statement: OmsStatement, cancel: threading.Event | None
    ) -> list[RemoteObject]:
        """The objects an OMS signature pins: the store's listing under the prefix must
        be exactly its file list (ignore rules applied, the signature object itself
        aside), refused before a single byte is downloaded otherwise."""
        listed, _ = self.store.list(location, cancel)
        own = statement.origin
        by_name = {o.name: o for o in listed if location.object_uri(o.name) != own}
        problems = compare_files(statement, location.uri.rstrip("/"), list(by_name), {})
        if problems:
            first = problems[0]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            first.message += f"{more}; nothing was downloaded"
            raise first
        return [by_name[f] for f in sorted(statement.files)]

    def _manifest(
        self, name: str, source: str, cancel: threading.Event | None = None
    ) -> _Manifest | None:
        """The model's manifest, parsed and signature-checked, as a local file path.

        With ``--trust-key`` every manifest must be signed by one (refused otherwise);
        without, a local manifest is the operator's own file, and an ``s3://`` one is
        marked unsigned (it is then no trust root for a remote source)."""
        path = self.verify.manifest_for(name)
        if path is None:
            return None
        if is_remote(path):
            location = parse_s3_uri(path.rpartition("/")[0] + "/")
            object_name = path.rpartition("/")[2]
            raw = self._read_small(location, object_name, MAX_MANIFEST_BYTES, cancel)
            cache = os.path.join(self.options.cache_dir, "manifests")
            os.makedirs(cache, mode=0o700, exist_ok=True)
            local = os.path.join(cache, hashlib.sha256(raw).hexdigest()[:32] + ".json")
            write_atomic(local, raw, mode=0o600)
            manifest = parse_manifest(path, raw)
            manifest = dataclasses.replace(manifest, path=local)
        else:
            raw = read_operator_file(path, MAX_MANIFEST_BYTES, ManifestSyntaxError)
            manifest = parse_manifest(path, raw)
        signed = False
        if self.verify.trust_keys:
            check_signature(manifest, [load_public_key(k) for k in self.verify.trust_keys])
            signed = True
        return _Manifest(manifest, path, signed)

    def _read_small(
        self,
        location: S3Location,
        name: str,
        limit: int,
        cancel: threading.Event | None = None,
        too_large: type[CheckpointError] = ManifestSyntaxError,
    ) -> bytes:
        """A small object whole, in memory: at most ``limit`` bytes, whatever the store
        announces or sends (the GET asks for the HEAD's size and reads no more)."""
        obj = self.store.head(location, name, cancel)
        if obj.size > limit:
            raise too_large(location.object_uri(name), f"larger than the {limit}-byte limit")
        data = (
            b"".join(self.store.get_range(location, obj, 0, obj.size, 1 << 20, cancel=cancel))
            if obj.size
            else b""
        )
        if len(data) != obj.size:
            raise ObjectTruncated(location.object_uri(name), f"got {len(data)} of {obj.size} bytes")
        return data

    def _select_model_files(
        self,
        location: S3Location,
        manifest: Manifest | None,
        cancel: threading.Event | None = None,
    ) -> list[RemoteObject]:
        listed, skipped = self.store.list(location, cancel)
        by_name = {o.name: o for o in listed}
        if manifest is not None:
            problems = []
            for fname, entry in sorted(manifest.files.items()):
                got = by_name.get(fname)
                if got is None:
                    problems.append(f"{fname} is listed in the manifest but not in the store")
                elif got.size != entry.size:
                    problems.append(
                        f"{fname} is {got.size} bytes in the store, the manifest says {entry.size}"
                    )
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise ManifestMismatchError(
                    location.uri,
                    f"the store does not hold what manifest {manifest.path} describes: "
                    f"{problems[0]}{more}; nothing was downloaded",
                )
            return [by_name[f] for f in sorted(manifest.files)]
        chosen = [o for o in listed if _MODEL_FILE.match(o.name)]
        for o in chosen:
            if o.name.endswith(".json") and o.size > MAX_JSON_BYTES:
                raise ObjectTooLarge(
                    location.object_uri(o.name),
                    f"{o.size} bytes: larger than the {MAX_JSON_BYTES}-byte limit for a "
                    "JSON file of a model directory; not downloaded",
                )
        if "config.json" not in {o.name for o in chosen}:
            raise ObjectNotFound(
                location.object_uri("config.json"),
                f"no config.json under the prefix ({len(listed)} objects, {skipped} skipped): "
                "not a model directory",
            )
        return sorted(chosen, key=lambda o: o.name)

    # --- adapters --------------------------------------------------------------------

    def adapter_present(self, source: str, roots: Sequence[S3Location]) -> bool:
        """Whether the ``s3://`` adapter at ``source`` (under one of ``roots``) has its
        config object: one HEAD, nothing downloaded (a load on request asks first)."""
        location = adapter_location(source, tuple(roots))
        try:
            self.store.head(location, ADAPTER_FILES[0])
        except ObjectNotFound:
            return False
        return True

    def resolve_adapter(
        self,
        source: str,
        roots: Sequence[S3Location],
        expected_digest: str | None,
        admit: Callable[[Sequence[RemoteObject]], None] | None = None,
        statement: OmsStatement | None = None,
    ) -> Resolved:
        """The adapter's version directory for an ``s3://`` adapter under one of
        ``roots``. Without ``expected_digest`` or an OMS ``statement`` (verified) the
        adapter is accepted only with ``--trust-object-store``. ``admit(objects)`` judges
        the sizes the store gives against every limit and budget before the first GET:
        what it refuses is never downloaded."""
        with self._accounted():
            return self._resolve_adapter(source, roots, expected_digest, admit, statement)

    def _resolve_adapter(
        self,
        source: str,
        roots: Sequence[S3Location],
        expected_digest: str | None,
        admit: Callable[[Sequence[RemoteObject]], None] | None,
        statement: OmsStatement | None = None,
    ) -> Resolved:
        location = adapter_location(source, tuple(roots))
        if statement is not None:
            unsigned = [f for f in ADAPTER_FILES if f not in statement.files]
            if unsigned:
                raise ManifestMismatchError(
                    location.object_uri(unsigned[0]),
                    f"is not in OMS signature {statement.origin}; nothing was downloaded",
                )
            objects = self._select_signed_files(location, statement, None)
            if admit is not None:
                admit(objects)
            directory, fetched, source_dir = self._bring(
                location.uri,
                "adapter",
                location,
                objects,
                None,
                None,
                _Expected(statement.files, f"OMS signature {statement.origin}"),
            )
            return Resolved(directory, None, fetched, source_dir)
        if expected_digest is None and not self.options.trust_object_store:
            raise RemoteTrustError(
                f"adapter {location.uri} comes from an object store, which is not a trust root: "
                "give LoadAdapter its expected_digest, or start the daemon with "
                "--trust-object-store"
            )
        objects = [self.store.head(location, f) for f in ADAPTER_FILES]
        if admit is not None:
            admit(objects)
        directory, fetched, source_dir = self._bring(
            location.uri, "adapter", location, objects, None
        )
        return Resolved(directory, None, fetched, source_dir)

    # --- the download itself ---------------------------------------------------------

    def _bring(
        self,
        name: str,
        kind: str,
        location: S3Location,
        objects: list[RemoteObject],
        manifest: Manifest | None,
        cancel: threading.Event | None = None,
        expected: _Expected | None = None,
    ) -> tuple[str, int, str]:
        if not self.options.cache_dir:
            raise UsageError(f"{location.uri}: remote sources need a cache directory (--cache-dir)")
        started = time.monotonic()
        # The process's CPU while it downloads (every thread: GETs, checks, journal; other
        # loads running at once too): what a download costs the host, beside its time.
        started_cpu = time.process_time()
        fetched = [0]  # what this download received, failed or not (set by _download)
        try:
            if expected is None and manifest is not None:
                expected = _Expected(
                    {f: e.sha256 for f, e in manifest.files.items()}, f"manifest {manifest.path}"
                )
            directory, outcome, source_dir = self._download(
                name, kind, location, objects, manifest, fetched, cancel, expected
            )
        except BaseException as exc:
            logs.event(
                "download",
                logging.WARNING,
                phase="failed",
                source=name,
                uri=location.uri,
                bytes=fetched[0],
                error=echo(str(exc)) if not isinstance(exc, WeightdError) else str(exc),
            )
            raise
        seconds = time.monotonic() - started
        if self.metrics is not None:
            self.metrics.seconds.labels(kind).observe(seconds)
            self.metrics.downloads.labels(kind, outcome).inc()
        logs.event(
            "download",
            phase="done",
            source=name,
            uri=location.uri,
            outcome=outcome,
            files=len(objects),
            bytes=fetched[0],
            seconds=seconds,
            process_cpu_s=time.process_time() - started_cpu,
            directory=directory,
        )
        return directory, fetched[0], source_dir

    def _download(
        self,
        name: str,
        kind: str,
        location: S3Location,
        objects: list[RemoteObject],
        manifest: Manifest | None,
        fetched: list[int],
        cancel: threading.Event | None,
        expected: _Expected | None = None,
    ) -> tuple[str, str, str]:
        settings = self.options.download
        fp = fingerprint(objects)
        endpoint = self.options.s3.endpoint
        with SourceDir.open(self.options.cache_dir, endpoint, location, cancel) as cache:
            warm = cache.complete(fp, objects)
            if warm is not None:
                return warm, "warm", cache.path
            # The cache holds what serves and this download, nothing more (the sizing:
            # two versions per source at most, during a reload); with nothing serving,
            # the newest other version stays (a restart may find the store back on it).
            keep = self._keep(cache.path)
            cache.prune(keep, keep_newest=max(0, KEEP_VERSIONS - 1 - len(keep)))
            directory, journal = cache.partial(fp, objects, settings.part_bytes)
            already = journal.done_bytes()
            total = sum(o.size for o in objects)
            logs.event(
                "download",
                phase="start",
                source=name,
                uri=location.uri,
                files=len(objects),
                total=total,
                resumed_bytes=already,
            )

            plain_md5 = {o.name for o in objects if _PLAIN_MD5.match(o.etag)}
            hasher = TensorChecker(
                location,
                manifest,
                journal.part_bytes,
                frozenset() if expected else plain_md5,
                sha256=expected is not None,
            )
            hashes: dict[str, FileHashes] = {}

            def check_file(obj: RemoteObject, path: str) -> None:
                hashes[obj.name] = self._check_file(location, obj, path, expected, hasher)

            download = Download(
                self.store,
                location,
                objects,
                directory,
                journal,
                os.path.join(directory, JOURNAL),
                settings,
                check_file=check_file,
                progress=_Progress(name, location.uri, already),
                on_range=hasher,
                cancel=cancel,
            )
            try:
                download.run()
            except CheckpointError:  # a digest, header or tensor differs from the manifest
                cache.discard(directory)  # the store's bytes are wrong: keep none of them
                raise
            finally:
                fetched[0] = download.fetched
                if self.metrics is not None:
                    self.metrics.bytes.labels(kind).inc(download.fetched)
            final = cache.publish(fp, directory, list(self._keep(cache.path)))
            self._seed_hash_cache(final, hashes)
        return final, "resumed" if already else "downloaded", cache.path

    def _seed_hash_cache(self, directory: str, hashes: dict[str, FileHashes]) -> None:
        """Record what the download's one pass hashed, so the local verification that
        follows reads the digests instead of hashing the same bytes a second time. Keyed
        as the hash cache keys every shard (path, inode, size, mtime, ctime): a file
        changed after this is hashed again, as any would be."""
        cache_dir = self.verify.hash_cache_dir
        if cache_dir is None or self.verify.reverify:
            return
        root = os.path.realpath(directory)
        entries = {}
        for name, h in hashes.items():
            if not name.endswith(".safetensors"):
                continue
            path = os.path.join(root, name)
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            ranges = tuple(TensorRange(t, off, n) for t, off, n, _ in h.tensors)
            digests = ShardDigests(st.st_size, h.sha256, {t: d for t, _, _, d in h.tensors})
            entries[name] = CacheEntry(path, FileIdentity.of(st), ranges, digests)
        if entries:
            HashCache(cache_dir, root).update(entries)

    def _check_file(
        self,
        location: S3Location,
        obj: RemoteObject,
        path: str,
        expected: _Expected | None,
        hasher: TensorChecker,
    ) -> FileHashes:
        """The file's hashes from the download's one pass, compared with the SHA-256 the
        manifest or OMS signature gives (or a plain-MD5 ETag without either) before the
        file is renamed in."""
        uri = location.object_uri(obj.name)
        size = os.path.getsize(path)
        if size != obj.size:
            raise ObjectTruncated(uri, f"{size} bytes on disk, the object is {obj.size}")
        got = hasher.finish(obj, path)
        if expected is not None:
            want = expected.sha256[obj.name]
            if got.sha256 != want:
                raise DigestMismatchError(
                    uri,
                    f"sha256 is {got.sha256}, {expected.source} says {want}: the bucket "
                    "does not hold the signed bytes; refused before serving (the download "
                    "stopped here)",
                )
            return got
        plain = _PLAIN_MD5.match(obj.etag)
        if plain is not None and got.md5 != plain.group(1):
            raise DigestMismatchError(
                uri, f"MD5 is {got.md5}, the object's ETag says {plain.group(1)}"
            )
        return got
