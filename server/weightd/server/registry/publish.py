"""``Publish``: a trainer's checkpoint becomes the model's next version.

The simple way first: the trainer saves safetensors (a directory, or an ``s3://``
prefix) and asks the daemon to serve it. The steps, in order, under the model's
reload lock (a reload and a publish of one model never interleave):

1. **verify** it aside exactly as any load is verified (:func:`.loading.load_source`:
   the daemon's trust options, an ``s3://`` source brought into the cache first), with
   the manifest the request names where one is given;
2. **prepare** it: :data:`PrepareVersion`, the one hook that does the work a version
   needs before engines move to it (today: the shared-memory packs of the layouts in
   use, :mod:`weightd.server.transports.prepare`), called after verification and
   before anything is announced;
3. **publish** it: the registry swaps it in; its version number is assigned there and
   the watch stream announces it READY (:mod:`.versions`).

The model then follows the new source (a later reload re-reads it). On any failure
nothing is published and the model keeps serving what it served.

A trainer may also hand over its tensors in memory (:meth:`Publisher.publish_memory`,
:mod:`.memory`): step 1 is then the checks of a sealed region against the serving
version and one hash pass over it; steps 2 and 3 are the same.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..base.cleanup import on_error
from ..base.errors import ModelNotReady, RequestPathError
from ..sources.location import is_remote
from ..telemetry import logs
from ..trust.verify import VerifyOptions
from .loading import Reloader, load_observed, load_source, publish_source
from .memory import (
    check_trust,
    memory_root,
    region_from_chunks,
    size_limit,
    version_from_memory,
)
from .models import LoadedModel

log = logging.getLogger("weightd")


@dataclass(frozen=True)
class Prepared:
    """What preparing a version did (for the reply and the log)."""

    packs_built: int = 0
    seconds: float = 0.0


#: Work a verified version needs before it is announced; raises to refuse publishing it.
PrepareVersion = Callable[[LoadedModel], Prepared]


def no_preparation(model: LoadedModel) -> Prepared:
    return Prepared()


@dataclass(frozen=True)
class Published:
    model: LoadedModel
    verify_seconds: float
    prepared: Prepared


def check_source(source: str, what: str = "source") -> str:
    """An ``s3://`` prefix, or an absolute local path without NUL bytes (the caller's
    mistake otherwise: a relative path would depend on the daemon's working directory)."""
    if not source:
        raise RequestPathError(f"Publish names no {what} (a directory or an s3:// prefix)")
    if "\0" in source:
        raise RequestPathError(f"{what} {source[:64]!r} contains a NUL byte")
    if not is_remote(source) and not os.path.isabs(source):
        raise RequestPathError(
            f"{what} {source[:256]!r} is a relative path; name an absolute directory "
            "or an s3:// prefix"
        )
    return source


class Publisher:
    """Publishes new versions through a :class:`.loading.Reloader`'s lock and options."""

    def __init__(
        self, reloader: Reloader, prepare_version: PrepareVersion = no_preparation
    ) -> None:
        self._reloader = reloader
        self.prepare_version = prepare_version

    def publish(self, name: str, source: str, manifest: str = "") -> Published:
        check_source(source)
        if manifest:
            check_source(manifest, "manifest")
        reloader = self._reloader
        name, current = reloader.current_model(name)

        def load() -> tuple[LoadedModel, float]:
            return self._load(name, current, source, manifest)

        return self._publish(name, source, load)

    def publish_memory(
        self, name: str, fd: int, still_wanted: Callable[[], None] = lambda: None
    ) -> Published:
        """Publish the tensors in the sealed memfd ``fd`` (a trainer's, or one the daemon
        filled from its gRPC stream) as ``name``'s next version (:mod:`.memory`).

        Takes ``fd`` over (closed on every failure; the version's once published).
        ``still_wanted()`` runs just before the commit and raises (:class:`PublishAborted`)
        when the trainer is gone: a version its trainer did not see accepted is never
        published. A later reload of the model is refused (:class:`NoSourceToReload`):
        there are no files to re-read, and the older weights on disk must not quietly
        come back; publishing a directory makes the model follow it again.
        """
        reloader = self._reloader
        try:
            name, current = reloader.current_model(name)
            if current is None:
                raise ModelNotReady(
                    f"model {name!r} serves no version (its load failed): a publish from "
                    "memory needs a serving version to check the tensors against; publish "
                    "a directory first",
                    model=name,
                )
            check_trust(reloader.options, name)
        except BaseException:
            os.close(fd)
            raise
        serving = current

        def load() -> tuple[LoadedModel, float]:
            started = time.monotonic()
            threads = reloader.options.threads if reloader.options is not None else None
            new = version_from_memory(fd, serving, threads)
            return new, time.monotonic() - started

        return self._publish(name, memory_root(name), load, still_wanted)

    def memory_limit(self, name: str) -> tuple[str, int]:
        """The model ``name`` names (empty: the only one) and the most bytes a region
        holding its next version may have (:func:`.memory.size_limit`)."""
        name, current = self._reloader.current_model(name)
        if current is None:
            raise ModelNotReady(
                f"model {name!r} serves no version (its load failed): a publish from memory "
                "needs a serving version to check the tensors against; publish a directory",
                model=name,
            )
        return name, size_limit(current)

    def publish_chunks(
        self,
        name: str,
        total: int,
        chunks: Iterator[bytes],
        still_wanted: Callable[[], None] = lambda: None,
    ) -> Published:
        """:meth:`publish_memory` of a region the daemon fills from ``chunks`` (the
        PublishTensors stream) and seals itself; a stream that breaks publishes nothing."""
        started = time.monotonic()
        try:
            name, limit = self.memory_limit(name)
            check_trust(self._reloader.options, name)
            fd = region_from_chunks(total, limit, chunks)
        except Exception as exc:
            logs.event(
                "publish",
                logging.ERROR,
                model=name,
                source="PublishTensors stream",
                outcome="failed",
                error=str(exc),
                seconds=time.monotonic() - started,
            )
            raise
        return self.publish_memory(name, fd, still_wanted)

    def _publish(
        self,
        name: str,
        source: str,
        load: Callable[[], tuple[LoadedModel, float]],
        still_wanted: Callable[[], None] = lambda: None,
    ) -> Published:
        """Verify (``load``), prepare and publish under ``name``'s reload lock; on any
        failure the version is discarded and the serving one untouched."""
        reloader = self._reloader
        started = time.monotonic()
        with reloader.exclusive(name):
            try:
                new, seconds = load()
                with on_error(lambda: self._discard(new), f"the version of {name} from {source}"):
                    prepared = self.prepare_version(new)
                    still_wanted()
                    publish_source(
                        reloader.registry, new, None if new.from_memory else reloader.resolver
                    )
            except Exception as exc:
                logs.event(
                    "publish",
                    logging.ERROR,
                    model=name,
                    source=source,
                    outcome="failed",
                    error=str(exc),
                    seconds=time.monotonic() - started,
                )
                raise
            reloader.follow(name, source)
        logs.event(
            "publish",
            model=name,
            source=source,
            outcome="ok",
            version=new.version,
            tensors=len(new.checkpoint.tensors),
            bytes=new.checkpoint.total_bytes,
            verify_seconds=seconds,
            packs_built=prepared.packs_built,
            prepare_seconds=prepared.seconds,
        )
        return Published(new, seconds, prepared)

    def _discard(self, new: LoadedModel) -> None:
        """A verified version that will not be published: its files closed, and its
        downloaded copy (an ``s3://`` source) no longer kept."""
        new.store.close()
        if self._reloader.resolver is not None and not new.from_memory:
            self._reloader.resolver.reject(new.checkpoint.root)

    def _load(
        self, name: str, current: LoadedModel | None, source: str, manifest: str
    ) -> tuple[LoadedModel, float]:
        """Verify ``source`` as the reloader verifies any load, with ``manifest`` (if
        given) as this model's manifest."""
        reloader = self._reloader
        options = reloader.options
        resolver = reloader.resolver
        tables = reloader.tables_of(current)
        if manifest:
            base = options if options is not None else VerifyOptions()
            options = dataclasses.replace(base, manifests={**base.manifests, name: manifest})
            if resolver is not None:
                resolver = resolver.with_verify(options)
        if resolver is None and not is_remote(source):
            return load_observed(source, name, reloader.metrics, tables, options)
        return load_source(source, name, reloader.metrics, tables, options, resolver)
