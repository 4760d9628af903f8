"""Loading and reloading models with their lifecycle events and metrics.

:func:`load_observed` wraps :func:`~.models.load_model` (verify before publish) with
the ``verified``/``verify_failed`` events and the verification metrics.

:class:`Reloader` is a minimal *registry-level* reload, written for the admin
``Reload`` RPC: the new version is loaded and verified entirely aside, and is swapped
in only when the whole of it passed; on any failure the old version keeps serving
untouched. It is deliberately separate from ``ModelRegistry`` so it can be
reconciled with a registry-native ``ModelRegistry.reload(name)`` when that lands.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..base.errors import InvalidRequest, ModelNotFound, ModelNotReady, WeightdError
from ..plan.rules import RuleTable
from ..sources.resolver import SourceResolver
from ..telemetry import logs
from ..telemetry.metrics import Metrics, failure_reason
from ..trust.verify import VerifyOptions
from .models import LoadedModel, ModelRegistry, load_model

log = logging.getLogger("weightd")


def load_observed(
    directory: str,
    name: str,
    metrics: Metrics | None,
    tables: Sequence[RuleTable] = (),
    options: VerifyOptions | None = None,
) -> tuple[LoadedModel, float]:
    """Load and verify one model; record the outcome. Returns the model and seconds taken."""
    started = time.monotonic()
    try:
        model = load_model(directory, name, tables, options=options)
    except BaseException as exc:
        seconds = time.monotonic() - started
        reason = failure_reason(exc)
        if metrics is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            metrics.verify_failures.labels(name, reason).inc()
        # The error itself is reported once, by whoever handles it: the CLI's one line
        # at start-up, the ``reload`` event and the RPC status on a reload.
        logs.event("verify_failed", logging.WARNING, model=name, reason=reason, seconds=seconds)
        raise
    seconds = time.monotonic() - started
    if metrics is not None:
        metrics.verify_seconds.labels(name).observe(seconds)
    ckpt = model.checkpoint
    logs.event(
        "verified",
        model=name,
        tensors=len(ckpt.tensors),
        bytes=ckpt.total_bytes,
        shards=len(ckpt.shards),
        seconds=seconds,
    )
    return model, seconds


def load_source(
    source: str,
    name: str,
    metrics: Metrics | None,
    tables: Sequence[RuleTable] = (),
    options: VerifyOptions | None = None,
    resolver: SourceResolver | None = None,
) -> tuple[LoadedModel, float]:
    """:func:`load_observed` of ``source``: a local directory as it is, an ``s3://`` one
    first brought into the cache (downloaded, or found warm) by ``resolver``."""
    if resolver is not None:
        resolved = resolver.resolve_model(name, source)
        source = resolved.directory
        options = resolved.options or options
    return load_observed(source, name, metrics, tables, options)


@dataclass(frozen=True)
class ReloadResult:
    model: LoadedModel
    seconds: float


@dataclass(frozen=True)
class ReloadOutcome:
    """How one model's reload went, for SIGHUP's reload of every model."""

    name: str
    ok: bool
    detail: str  # what was published, or why not
    seconds: float


class Reloader:
    """Reloads one model at a time per name; concurrent reloads of one model queue.

    ``sources`` maps model names to the directories they were configured with (not the
    resolved path), so a directory that is a symlink flipped to a new version is
    followed again on reload. ``options`` are the trust and hash-cache options.
    """

    def __init__(
        self,
        registry: ModelRegistry,
        metrics: Metrics | None = None,
        *,
        sources: Mapping[str, str] | None = None,
        options: VerifyOptions | None = None,
        resolver: SourceResolver | None = None,
    ) -> None:
        self._registry = registry
        self._resolver = resolver
        self._metrics = metrics
        self._sources = dict(sources or {})
        self._options = options
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}

    def _current(self, name: str) -> LoadedModel:
        published = {m.name: m for m in self._registry.models()}
        every = self._registry.names()
        if not name:
            if len(every) != 1:
                raise InvalidRequest(
                    f"this daemon serves {len(every)} models ({', '.join(every)}); name one"
                )
            (name,) = every
        model = published.get(name)
        if model is not None:
            return model  # broken models too: a reload is how they come back
        if name in every:
            raise ModelNotReady(f"model {name!r} is still being verified; reload it afterwards")
        raise ModelNotFound(f"model {name!r} is not served here (serving: {', '.join(every)})")

    # --- what a Publisher shares (registry/publish.py) ------------------------------

    @property
    def registry(self) -> ModelRegistry:
        return self._registry

    @property
    def options(self) -> VerifyOptions | None:
        return self._options

    @property
    def resolver(self) -> SourceResolver | None:
        return self._resolver

    @property
    def metrics(self) -> Metrics | None:
        return self._metrics

    def current_model(self, name: str) -> LoadedModel:
        """The published model ``name`` (empty: the only one), broken ones included."""
        return self._current(name)

    def follow(self, name: str, source: str) -> None:
        """Reload ``name`` from ``source`` from now on (a published version's source)."""
        with self._guard:
            self._sources[name] = source

    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[None]:
        """Hold ``name``'s reload lock, so that nothing else reloads it meanwhile (the file
        watcher's restore takes it too, and never races an admin reload)."""
        with self._guard:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            yield

    def load_aside(self, model: LoadedModel) -> tuple[LoadedModel, float]:
        """Load and verify ``model``'s directory again with its rules and the daemon's trust
        options, publishing nothing; the caller publishes or closes the result. A remote
        source is listed again first: a new version in the store is downloaded (aside,
        into its own version directory) and verified before anything is swapped."""
        directory = self._sources.get(model.name, model.checkpoint.root)
        return load_source(
            directory, model.name, self._metrics, model.tables, self._options, self._resolver
        )

    def reload(self, name: str) -> ReloadResult:
        """Re-read and re-verify ``name`` from its directory; swap in only on success."""
        current = self._current(name)
        with self.exclusive(current.name):
            try:
                new, seconds = self.load_aside(current)
            except Exception as exc:
                if self._metrics is not None:
                    self._metrics.reloads.labels(current.name, "failed").inc()
                logs.event(
                    "reload",
                    logging.ERROR,
                    model=current.name,
                    outcome="failed",
                    serving="previous version" if current.broken is None else "nothing",
                    error=str(exc),
                )
                raise
            self._registry.publish(new)
        if self._metrics is not None:
            self._metrics.reloads.labels(current.name, "ok").inc()
        logs.event(
            "reload",
            model=current.name,
            outcome="ok",
            tensors=len(new.checkpoint.tensors),
            bytes=new.checkpoint.total_bytes,
            seconds=seconds,
        )
        return ReloadResult(new, seconds)

    def reload_all(self) -> list[ReloadOutcome]:
        """Reload every published model, each independently (SIGHUP); never raises."""
        outcomes = []
        for model in self._registry.models():
            started = time.monotonic()
            try:
                result = self.reload(model.name)
            except Exception as exc:  # logged by reload(); the old version keeps serving
                if not isinstance(exc, WeightdError):
                    log.exception("reload of model %s failed", model.name)
                outcomes.append(
                    ReloadOutcome(model.name, False, str(exc), time.monotonic() - started)
                )
                continue
            ckpt = result.model.checkpoint
            detail = f"{len(ckpt.tensors)} tensors, {ckpt.total_bytes} bytes"
            outcomes.append(ReloadOutcome(model.name, True, detail, result.seconds))
        return outcomes
