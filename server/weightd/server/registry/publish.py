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
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..base.cleanup import on_error
from ..base.errors import RequestPathError
from ..sources.location import is_remote
from ..telemetry import logs
from ..trust.verify import VerifyOptions
from .loading import Reloader, load_observed, load_source, publish_source
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
        started = time.monotonic()
        with reloader.exclusive(name):
            try:
                new, seconds = self._load(name, current, source, manifest)
                with on_error(lambda: self._discard(new), f"the version of {name} from {source}"):
                    prepared = self.prepare_version(new)
                    publish_source(reloader.registry, new, reloader.resolver)
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
        if self._reloader.resolver is not None:
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
