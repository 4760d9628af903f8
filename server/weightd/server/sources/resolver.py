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

import copy
import dataclasses
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
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
    UsageError,
)
from ..telemetry import logs
from ..telemetry.metrics import SourceMetrics, source_failure_reason
from ..telemetry.progress import render_bar
from ..trust.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ..trust.signing import check_signature, load_public_key
from ..trust.verify import VerifyOptions, read_operator_file
from .cache import JOURNAL, SourceDir, fingerprint
from .download import Download, DownloadSettings
from .location import S3Location, adapter_location, is_remote, parse_s3_uri
from .s3 import RemoteObject, S3Settings, S3Store
from .tensorcheck import TensorChecker

log = logging.getLogger("weightd.sources")

#: Files of a model directory downloaded when no manifest lists them.
_MODEL_FILE: Final = re.compile(r"^[^/]+\.(json|safetensors)$")
#: The files an adapter directory holds (what adapters.load reads).
ADAPTER_FILES: Final = ("adapter_config.json", "adapter_model.safetensors")
_PLAIN_MD5: Final = re.compile(r'^"?([0-9a-f]{32})"?$')
#: Largest ``.json`` downloaded without a manifest pinning its size (an index of a
#: very large model is a few MiB; the local reader caps what it parses anyway).
MAX_JSON_BYTES: Final = 64 << 20
#: Version directories remembered per source as possibly serving (the current one, the
#: one before it, and versions whose verification is still deciding).
MAX_HANDED: Final = 4
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
class Resolved:
    """A source as a local directory, and the verify options that go with it."""

    directory: str
    options: VerifyOptions | None
    downloaded: int  # bytes fetched from the store for it (0: warm)


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


def _file_digest(path: str, algorithm: str) -> str:
    """Hex digest of the file at ``path`` (not followed if a link), read by descriptor."""
    h = hashlib.new(algorithm, usedforsecurity=algorithm != "md5")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        while chunk := os.read(fd, 8 << 20):
            h.update(chunk)
    finally:
        os.close(fd)
    return h.hexdigest()


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
        #: Version directories handed out per source (newest last): a reload's prune
        #: never removes one of them, since the model may still be serving from it.
        self._handed: dict[str, list[str]] = {}
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

    # --- models ----------------------------------------------------------------------

    def needs_resolving(self, name: str, source: str) -> bool:
        manifest = self.verify.manifest_for(name)
        return is_remote(source) or (manifest is not None and is_remote(manifest))

    def resolve_model(self, name: str, source: str) -> Resolved:
        """The local directory to load model ``name`` from (``source`` itself if local)."""
        if not self.needs_resolving(name, source):
            return Resolved(source, None, 0)
        manifest = self._manifest(name, source)
        options = self.verify
        if manifest is not None:
            options = dataclasses.replace(
                options, manifests={**options.manifests, name: manifest.path}
            )
        if not is_remote(source):
            return Resolved(source, options, 0)
        location = parse_s3_uri(source)
        if manifest is None and not self.options.trust_object_store:
            raise RemoteTrustError(
                f"model {name!r} comes from {location.uri}, and an object store is not a trust "
                f"root: give --manifest {name}=FILE (a local file or an s3:// object) made with "
                "`weightd manifest create`, or --trust-object-store to serve whatever the "
                "bucket holds"
            )
        objects = self._select_model_files(location, manifest)
        directory, fetched = self._bring(name, "model", location, objects, manifest)
        return Resolved(directory, options, fetched)

    def _manifest(self, name: str, source: str) -> Manifest | None:
        """The model's manifest, parsed and signature-checked, as a local file path."""
        path = self.verify.manifest_for(name)
        if path is None:
            return None
        if is_remote(path):
            location = parse_s3_uri(path.rpartition("/")[0] + "/")
            object_name = path.rpartition("/")[2]
            raw = self._read_small(location, object_name, MAX_MANIFEST_BYTES)
            cache = os.path.join(self.options.cache_dir, "manifests")
            os.makedirs(cache, mode=0o700, exist_ok=True)
            local = os.path.join(cache, hashlib.sha256(raw).hexdigest()[:32] + ".json")
            write_atomic(local, raw, mode=0o600)
            manifest = parse_manifest(path, raw)
            manifest = dataclasses.replace(manifest, path=local)
        else:
            raw = read_operator_file(path, MAX_MANIFEST_BYTES, ManifestSyntaxError)
            manifest = parse_manifest(path, raw)
        if self.verify.trust_keys:
            check_signature(manifest, [load_public_key(k) for k in self.verify.trust_keys])
        return manifest

    def _read_small(self, location: S3Location, name: str, limit: int) -> bytes:
        obj = self.store.head(location, name)
        if obj.size > limit:
            raise ManifestSyntaxError(
                location.object_uri(name), f"larger than the {limit}-byte limit"
            )
        data = (
            b"".join(self.store.get_range(location, obj, 0, obj.size, 1 << 20)) if obj.size else b""
        )
        if len(data) != obj.size:
            raise ObjectTruncated(location.object_uri(name), f"got {len(data)} of {obj.size} bytes")
        return data

    def _select_model_files(
        self, location: S3Location, manifest: Manifest | None
    ) -> list[RemoteObject]:
        listed, skipped = self.store.list(location)
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

    def resolve_adapter(
        self, source: str, roots: Sequence[S3Location], expected_digest: str | None
    ) -> tuple[str, str]:
        """(the adapter's version directory, its source cache directory) for an ``s3://``
        adapter under one of ``roots``. Without ``expected_digest`` the adapter is
        accepted only with ``--trust-object-store`` (the digest is its trust root)."""
        location = adapter_location(source, tuple(roots))
        if expected_digest is None and not self.options.trust_object_store:
            raise RemoteTrustError(
                f"adapter {location.uri} comes from an object store, which is not a trust root: "
                "give LoadAdapter its expected_digest, or start the daemon with "
                "--trust-object-store"
            )
        objects = [self.store.head(location, f) for f in ADAPTER_FILES]
        directory, _ = self._bring(location.uri, "adapter", location, objects, None)
        return directory, os.path.dirname(directory)

    # --- the download itself ---------------------------------------------------------

    def _bring(
        self,
        name: str,
        kind: str,
        location: S3Location,
        objects: list[RemoteObject],
        manifest: Manifest | None,
    ) -> tuple[str, int]:
        if not self.options.cache_dir:
            raise UsageError(f"{location.uri}: remote sources need a cache directory (--cache-dir)")
        started = time.monotonic()
        store = self.store
        retries_before = store.retries.total
        fetched = [0]  # what this download received, failed or not (set by _download)
        try:
            directory, outcome = self._download(name, kind, location, objects, manifest, fetched)
        except BaseException as exc:
            if self.metrics is not None and isinstance(exc, Exception):
                self.metrics.failures.labels(source_failure_reason(exc)).inc()
            logs.event(
                "download",
                logging.WARNING,
                phase="failed",
                source=name,
                uri=location.uri,
                bytes=fetched[0],
                error=str(exc),
            )
            raise
        finally:
            if self.metrics is not None:
                self.metrics.retries.inc(store.retries.total - retries_before)
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
            directory=directory,
        )
        return directory, fetched[0]

    def _download(
        self,
        name: str,
        kind: str,
        location: S3Location,
        objects: list[RemoteObject],
        manifest: Manifest | None,
        fetched: list[int],
    ) -> tuple[str, str]:
        settings = self.options.download
        fp = fingerprint(objects)
        endpoint = self.options.s3.endpoint
        with SourceDir.open(self.options.cache_dir, endpoint, location) as cache:
            warm = cache.complete(fp, objects)
            if warm is not None:
                self._hand_out(cache.path, warm)
                return warm, "warm"
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

            def check_file(obj: RemoteObject, path: str) -> None:
                self._check_file(location, obj, path, manifest)

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
                on_range=(
                    TensorChecker(location, manifest, journal.part_bytes)
                    if manifest is not None
                    else None
                ),
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
            with self._lock:
                keep = list(self._handed.get(cache.path, []))
            final = cache.publish(fp, directory, keep)
            self._hand_out(cache.path, final)
        return final, "resumed" if already else "downloaded"

    def _hand_out(self, source_dir: str, directory: str) -> None:
        with self._lock:
            handed = [d for d in self._handed.get(source_dir, []) if d != directory]
            self._handed[source_dir] = [*handed, directory][-MAX_HANDED:]

    def _check_file(
        self, location: S3Location, obj: RemoteObject, path: str, manifest: Manifest | None
    ) -> None:
        uri = location.object_uri(obj.name)
        size = os.path.getsize(path)
        if size != obj.size:
            raise ObjectTruncated(uri, f"{size} bytes on disk, the object is {obj.size}")
        if manifest is not None:
            want = manifest.files[obj.name].sha256
            got = _file_digest(path, "sha256")
            if got != want:
                raise DigestMismatchError(
                    uri,
                    f"sha256 is {got}, manifest {manifest.path} says {want}: the bucket does not "
                    "hold the manifest's bytes; refused before serving (the download stopped here)",
                )
            return
        plain = _PLAIN_MD5.match(obj.etag)
        if plain is not None:
            got = _file_digest(path, "md5")
            if got != plain.group(1):
                raise DigestMismatchError(
                    uri, f"MD5 is {got}, the object's ETag says {plain.group(1)}"
                )
