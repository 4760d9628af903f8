"""The file watcher: notices changed shards of served models, re-verifies, restores.

Fetches already catch a changed file on access (the store's check after every read,
every slice compared with its verified digest). The watcher adds what access cannot:

* a prompt, precise report without waiting for a fetch (the model goes NOT_SERVING
  with the reason, ``ListModels`` and ``weightd_model_state`` say why);
* ``chmod`` and friends (a ctime-only change) do not take a model down: the shard is
  re-hashed in the background against its verified digests, and only a mismatch
  marks it broken;
* recovery on an **atomic replace**: when a file is renamed over a served shard, the
  model's directory is verified again aside (every check, the daemon's trust
  options, a manifest if it has one) and published only if it holds exactly the
  served version's tensors — restoring a broken model. Different content is never
  published by the watcher (that is an operator's Reload); the model reports
  ``stale`` and keeps serving its verified, still-open files.

Why a periodic ``stat`` and not inotify: two syscalls per shard per interval cost
nothing, work on every file system (inotify misses changes made on another NFS
client) and need no watch on directories the daemon does not own.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from ..base.errors import DataIntegrityError
from ..store.shards import FileIdentity, OpenShard
from ..telemetry import logs
from ..trust.integrity import hash_checkpoint
from .filechange import (
    ChangeKind,
    ShardChange,
    inode_change,
    path_change,
    tensor_mismatch,
    version_difference,
)
from .loading import Reloader
from .models import LoadedModel, ModelRegistry

log = logging.getLogger("weightd.filewatch")


@dataclass
class _Seen:
    """What the watcher already knows of one served version."""

    ctimes: dict[str, int]  # shard -> the ctime its last re-hash accepted
    reported: set[str] = field(default_factory=set)  # content changes already reported
    #: The paths' identities when a restore was last tried: tried again only when they move.
    attempted: tuple[tuple[str, FileIdentity | None], ...] | None = None


def _stat(path: str) -> FileIdentity | None:
    try:
        return FileIdentity.of(os.stat(path))
    except FileNotFoundError:
        return None


class ShardWatcher:
    """Checks every served model's shards every ``interval`` seconds (see module doc)."""

    def __init__(
        self,
        registry: ModelRegistry,
        reloader: Reloader,
        interval: float,
        metrics: CollectorRegistry | None = None,
    ) -> None:
        self._registry = registry
        self._reloader = reloader
        self.interval = interval
        #: id(model) -> (the model, what is known of it); a LoadedModel is not hashable,
        #: and entries of versions no longer alive are dropped at each scan.
        self._seen: dict[int, tuple[weakref.ref[LoadedModel], _Seen]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weightd-filewatch", daemon=True)
        self._changes: Counter | None = None
        self._restores: Counter | None = None
        if metrics is not None:
            self._changes = Counter(
                "weightd_shard_changes",
                "Changes to served shard files the watcher noticed, by model and kind "
                "(metadata, content, replaced, removed).",
                ["model", "change"],
                registry=metrics,
            )
            self._restores = Counter(
                "weightd_model_restores",
                "Re-verifications after a shard was replaced on disk, by outcome (ok: the "
                "served version is back and published; differs; failed: did not verify).",
                ["model", "outcome"],
                registry=metrics,
            )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop watching. Waits a little for a pass in progress; a re-verification of a
        large model can take minutes, and shutdown must not wait for it (the thread is a
        daemon thread, and what it would publish no longer matters)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.scan()

    def scan(self) -> None:
        """One pass over every served model (the thread's body; tests call it directly)."""
        self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        for model in self._registry.models():
            if self._stop.is_set():
                return
            try:
                self.check(model)
            except Exception:  # a bug here must not stop the watching of other models
                log.exception("file watch of model %s failed", model.name)

    def check(self, model: LoadedModel) -> None:
        if model.from_memory:
            return  # a sealed memfd: nothing on disk to watch, and it cannot change
        known = self._seen.get(id(model))
        if known is not None and known[0]() is model:
            seen = known[1]
        else:
            shards = model.store.shards.values()
            seen = _Seen({s.name: s.identity.ctime_ns for s in shards})
            self._seen[id(model)] = (weakref.ref(model), seen)
        moved: list[ShardChange] = []
        snapshot: list[tuple[str, FileIdentity | None]] = []
        for shard in model.store.shards.values():
            try:
                held = FileIdentity.of(os.fstat(shard.fd))
            except OSError:
                return  # the store was closed (daemon stopping): nothing left to watch
            at_path = _stat(shard.path)
            snapshot.append((shard.name, at_path))
            on_path = path_change(shard.path, shard.identity, at_path)
            if on_path is not None:
                moved.append(on_path)
            on_inode = inode_change(shard.path, shard.identity, held, seen.ctimes[shard.name])
            if on_inode is None:
                continue
            if on_inode.kind is ChangeKind.CONTENT:
                if shard.name not in seen.reported:
                    seen.reported.add(shard.name)
                    self._report(model, on_inode)
                    self._registry.mark_broken(model, on_inode.detail)
            elif on_path is None and model.broken is None:
                self._rehash(model, shard, held, seen, on_inode)
            else:
                # Unlinked by a rename over its path (that moves ctime) or the model is
                # already down: nothing to re-hash; the path decides what happens next.
                seen.ctimes[shard.name] = held.ctime_ns
        if moved and tuple(snapshot) != seen.attempted:
            seen.attempted = tuple(snapshot)
            for change in moved:
                self._report(model, change)
            self._restore(model, moved)

    def _report(self, model: LoadedModel, change: ShardChange) -> None:
        if self._changes is not None:
            self._changes.labels(model.name, change.kind.value).inc()
        level = logging.INFO if change.kind is ChangeKind.METADATA else logging.WARNING
        logs.event(
            "file_changed", level, model=model.name, change=change.kind.value, detail=change.detail
        )

    def _rehash(
        self,
        model: LoadedModel,
        shard: OpenShard,
        held: FileIdentity,
        seen: _Seen,
        change: ShardChange,
    ) -> None:
        """A ctime-only change: hash the shard again; keep serving only if it still matches."""
        self._report(model, change)

        def unchanged_since_snapshot(name: str) -> None:
            model.store.check(name)
            now = FileIdentity.of(os.fstat(shard.fd))
            if now.ctime_ns != held.ctime_ns:
                raise DataIntegrityError(f"shard {shard.path} changed again while re-verified")

        try:
            digests = hash_checkpoint(
                model.checkpoint,
                model.store,
                threads=1,
                only={shard.name},
                check=unchanged_since_snapshot,
            )
        except Exception as exc:  # any failure to re-verify means: stop serving
            self._registry.mark_broken(model, f"re-verifying {shard.path} failed: {exc}")
            return
        wrong = tensor_mismatch(shard.path, digests, model.tensor_digests)
        if wrong is not None:
            self._registry.mark_broken(model, wrong)
            return
        seen.ctimes[shard.name] = held.ctime_ns
        logs.event(
            "file_changed",
            model=model.name,
            change="metadata",
            outcome="re-verified",
            shard=shard.path,
            tensors=len(digests),
        )

    def _restore(self, model: LoadedModel, moved: list[ShardChange]) -> None:
        """Verify the directory aside; publish it only if it is the served version."""
        detail = "; ".join(c.detail for c in moved)
        if any(c.kind is ChangeKind.REMOVED for c in moved):
            self._not_restored(model, detail, "removed")
            return
        with self._reloader.exclusive(model.name):
            if not any(m is model for m in self._registry.models()):
                return  # reloaded meanwhile: the new version is watched from now on
            try:
                new, seconds = self._reloader.load_aside(model)
            except Exception as exc:  # reported; the served version stays
                self._not_restored(
                    model, f"{detail}, by a version that does not verify: {exc}", "failed"
                )
                return
            diff = version_difference(
                model.checkpoint, model.tensor_digests, new.checkpoint, new.tensor_digests
            )
            if diff is not None:
                new.store.close()
                self._not_restored(
                    model,
                    f"{detail}, by content that differs from the served version: {diff}",
                    "differs",
                )
                return
            self._registry.publish(new)
        if self._restores is not None:
            self._restores.labels(model.name, "ok").inc()
        logs.event(
            "restore",
            model=model.name,
            outcome="ok",
            was=model.broken or "serving",
            seconds=seconds,
            detail=detail,
        )

    def _not_restored(self, model: LoadedModel, reason: str, outcome: str) -> None:
        if model.broken is None:
            then = "the verified version is still served (a Reload publishes what is on disk)"
        else:
            then = "the model stays down until the verified content is back or a Reload succeeds"
        self._registry.mark_stale(model, f"{reason}; {then}")
        if self._restores is not None:
            self._restores.labels(model.name, outcome).inc()
        logs.event("restore", logging.WARNING, model=model.name, outcome=outcome, detail=reason)
