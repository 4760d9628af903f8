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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ..base.errors import (
    InvalidRequest,
    ModelNotFound,
    ModelNotReady,
    NoSourceToReload,
    ReloadTimedOut,
    WeightdError,
    echo,
)
from ..base.words import count
from ..plan.rules import RuleTable
from ..sources.resolver import SourceResolver
from ..telemetry import logs
from ..telemetry.metrics import Metrics, failure_reason
from ..trust.verify import VerifyOptions
from .memory import is_memory_source
from .models import LoadedModel, ModelRegistry, load_model

log = logging.getLogger("weightd")

#: How long cancelled loads get to stop (hashing stops within a block) before start-up
#: ends without them.
CANCEL_SECONDS = 10.0


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
        cancelled = options is not None and options.cancel is not None and options.cancel.is_set()
        if not isinstance(exc, Exception) or cancelled:
            raise  # a signal stopping start-up, or the interpreter exiting: a cancel
        seconds = time.monotonic() - started
        reason = failure_reason(exc)
        if metrics is not None:
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
    cancel: threading.Event | None = None,
) -> tuple[LoadedModel, float]:
    """:func:`load_observed` of ``source``: a local directory as it is, an ``s3://`` one
    first brought into the cache (downloaded, or found warm) by ``resolver``.

    A cached version that fails verification is removed (nothing unverified stays); one
    that passes is the caller's to publish, then to :meth:`~SourceResolver.accept`
    (:func:`publish_source`). ``cancel`` ends a download early (a deadline, shutdown).
    """
    if resolver is not None:
        resolved = resolver.resolve_model(name, source, cancel)
        options = resolved.options or options
        try:
            return load_observed(resolved.directory, name, metrics, tables, options)
        except BaseException:
            resolver.reject(resolved.directory)
            raise
    return load_observed(source, name, metrics, tables, options)


def publish_source(
    registry: ModelRegistry, model: LoadedModel, resolver: SourceResolver | None
) -> None:
    """Publish ``model``; its cached version (if any) is then the one that serves."""
    registry.publish(model)
    if resolver is not None:
        resolver.accept(model.name, model.checkpoint.root)


def load_independently(
    registry: ModelRegistry,
    named: Sequence[tuple[str, str]],
    load: Callable[[str, str], LoadedModel],
    publish: Callable[[LoadedModel], None],
    wait: Callable[[threading.Thread], None] = lambda t: t.join(),
    cancel: threading.Event | None = None,
) -> list[tuple[str, BaseException]]:
    """Load every ``(name, source)`` on a thread of its own and publish each as soon as it
    verifies: one slow or failing model never delays another (a local model serves while
    an ``s3://`` one still downloads). A model whose load fails is marked ``failed`` in
    ``registry`` (the others serve; a reload retries it). Returns once every model has
    settled, with the failures in the order given; ``wait(thread)`` joins one loader
    (the daemon's waits in short steps, so a signal stops start-up promptly).

    Whatever ends a wait early (a signal stopping start-up) sets ``cancel``, which the
    loads watch, and gives them :data:`CANCEL_SECONDS` to stop before it propagates: a
    load that ends because it was cancelled is no failure and is not reported as one.
    """
    failures: dict[str, BaseException] = {}

    def run(name: str, source: str) -> None:
        try:
            publish(load(name, source))
        except BaseException as exc:
            if cancel is not None and cancel.is_set():
                return  # stopped by the cancel, not by anything wrong with the model
            failures[name] = exc
            registry.fail(name, str(exc) if isinstance(exc, WeightdError) else repr(exc)[:200])
            if isinstance(exc, Exception) and not isinstance(exc, WeightdError):
                log.error("loading model %s failed", name, exc_info=exc)
            if len(named) > 1:
                log.error(
                    "model %s failed to load: %s; the other models serve, a reload retries it",
                    name,
                    exc,
                )

    threads = [
        threading.Thread(target=run, args=(n, src), name=f"weightd-load-{i}", daemon=True)
        for i, (n, src) in enumerate(named)
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            wait(t)
    except BaseException:
        if cancel is not None:
            cancel.set()
            deadline = time.monotonic() + CANCEL_SECONDS
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        raise
    return [(n, failures[n]) for n, _ in named if n in failures]


def prepare_or_close(prepare: Callable[[LoadedModel], None] | None, model: LoadedModel) -> None:
    """Run ``prepare`` on a version about to be published; on failure close its files."""
    if prepare is None:
        return
    try:
        prepare(model)
    except BaseException:
        model.store.close()
        raise


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
        prepare: Callable[[LoadedModel], None] | None = None,
    ) -> None:
        self._registry = registry
        self._resolver = resolver
        self._metrics = metrics
        self._sources = dict(sources or {})
        self._options = options
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        #: The ``--rules`` tables, for a model that never loaded (set by the start-up).
        self.tables: tuple[RuleTable, ...] = ()
        #: Runs on a verified version before it is published (its declared layouts'
        #: packs are built there: ``transports/prebuild.py``); a failure fails the reload.
        self.prepare = prepare

    def _current(self, name: str) -> tuple[str, LoadedModel | None]:
        """The model ``name`` names, and its published version (None: its load failed,
        and a reload is how it comes back)."""
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
            return name, model  # broken models too: a reload is how they come back
        if name in every and self._registry.state(name)[0] == "failed" and name in self._sources:
            return name, None
        if name in every:
            raise ModelNotReady(
                f"model {name!r} is still being verified; reload it afterwards", model=name
            )
        raise ModelNotFound(
            f"model {echo(name)} is not served here (serving: {', '.join(every)})", model=name
        )

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

    def current_model(self, name: str) -> tuple[str, LoadedModel | None]:
        """The model ``name`` names (empty: the only one) and its published version,
        broken ones included; None when its load failed (a publish or a reload is how it
        comes back)."""
        return self._current(name)

    def tables_of(self, model: LoadedModel | None) -> tuple[RuleTable, ...]:
        """The rules tables a new version of ``model`` is planned with."""
        return tuple(model.tables) if model is not None else self.tables

    def follow(self, name: str, source: str) -> None:
        """Reload ``name`` from ``source`` from now on (a published version's source)."""
        with self._guard:
            self._sources[name] = source

    @contextlib.contextmanager
    def exclusive(self, name: str) -> Iterator[None]:
        """Hold ``name``'s reload lock, so that nothing else reloads it meanwhile (the file
        watcher's restore takes it too, and never races an admin reload)."""
        with self._lock_of(name):
            yield

    def _lock_of(self, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(name, threading.Lock())

    def load_aside(
        self, model: LoadedModel | str, cancel: threading.Event | None = None
    ) -> tuple[LoadedModel, float]:
        """Load and verify ``model``'s directory again with its rules and the daemon's trust
        options, publishing nothing; the caller publishes or closes the result. A remote
        source is listed again first: a new version in the store is downloaded (aside,
        into its own version directory) and verified before anything is swapped. A name
        (a model whose load failed) is loaded from its configured source."""
        if isinstance(model, str):
            name, directory, tables = model, self._sources[model], self.tables
        else:
            name = model.name
            directory = self._sources.get(name, model.checkpoint.root)
            tables = model.tables
        if is_memory_source(directory):
            raise NoSourceToReload(
                f"model {name!r}: its serving version was published from a trainer's memory "
                "and has no files to re-read (reloading older weights from disk instead "
                "would go back silently); the current version keeps serving. Publish a "
                "directory (weightd publish) to have the model follow one again",
                model=name,
            )
        return load_source(
            directory, name, self._metrics, tables, self._options, self._resolver, cancel
        )

    def reload(self, name: str, timeout: float | None = None) -> ReloadResult:
        """Re-read and re-verify ``name`` from its directory; swap in only on success.

        ``timeout`` (the caller's deadline, seconds): the call returns by then whatever
        happens. Waiting for another reload of the same model counts against it; a load
        still running at the deadline is cancelled (its downloads end at once), publishes
        nothing, and releases the model's reload lock when it stops, so no reload is
        ever blocked by one whose caller is gone.
        """
        name, current = self._current(name)
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        lock = self._lock_of(name)
        if not lock.acquire(
            timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())
        ):
            raise ReloadTimedOut(
                f"model {name!r}: another reload of it was still running at this call's "
                f"deadline ({timeout:g} s); nothing was changed"
            )
        job = _ReloadJob()
        worker = threading.Thread(
            target=self._run_job,
            args=(job, name, current, lock),
            name="weightd-reload-job",
            daemon=True,
        )
        worker.start()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not job.done.wait(left):
            with job.lock:
                job.abandoned = not job.finished
            if job.abandoned:
                job.cancel.set()
                if self._metrics is not None:
                    self._metrics.reloads.labels(name, "failed").inc()
                serving = "the previous version serves" if current is not None else "nothing"
                logs.event(
                    "reload",
                    logging.ERROR,
                    model=name,
                    outcome="timed_out",
                    serving=serving,
                    seconds=timeout,
                )
                raise ReloadTimedOut(
                    f"model {name!r}: the reload did not finish within {timeout:g} s; it was "
                    f"cancelled and publishes nothing ({serving})"
                )
            job.done.wait()  # it finished at that very moment: its outcome holds
        if job.error is not None:
            if self._metrics is not None:
                self._metrics.reloads.labels(name, "failed").inc()
            logs.event(
                "reload",
                logging.ERROR,
                model=name,
                outcome="failed",
                serving=(
                    "previous version"
                    if current is not None and current.broken is None
                    else "nothing"
                ),
                error=str(job.error),
            )
            raise job.error
        assert job.result is not None
        new = job.result.model
        if self._metrics is not None:
            self._metrics.reloads.labels(name, "ok").inc()
        logs.event(
            "reload",
            model=name,
            outcome="ok",
            tensors=len(new.checkpoint.tensors),
            bytes=new.checkpoint.total_bytes,
            seconds=job.result.seconds,
        )
        return job.result

    def _run_job(
        self, job: _ReloadJob, name: str, current: LoadedModel | None, lock: threading.Lock
    ) -> None:
        """The reload's load, on its own thread; publishes unless its caller gave up."""
        try:
            try:
                new, seconds = self.load_aside(current if current is not None else name, job.cancel)
                try:
                    prepare_or_close(self.prepare, new)  # declared layouts' packs, first
                except BaseException:
                    if self._resolver is not None:  # a cached version that never served
                        self._resolver.reject(new.checkpoint.root)
                    raise
            except BaseException as exc:
                with job.lock:
                    job.finished = True
                    job.error = exc
                return
            with job.lock:
                job.finished = True
                abandoned = job.abandoned
            if abandoned:
                new.store.close()
                if self._resolver is not None:
                    self._resolver.reject(new.checkpoint.root)
                log.warning(
                    "reload of model %s finished after its caller's deadline: not published",
                    name,
                )
                return
            publish_source(self._registry, new, self._resolver)
            job.result = ReloadResult(new, seconds)
        finally:
            lock.release()
            job.done.set()

    def reload_all(self) -> list[ReloadOutcome]:
        """Reload every published model (and every failed one), each on its own thread
        (SIGHUP): a model whose store is slow never holds up the others. Never raises;
        the outcomes are in the models' order."""
        published = {m.name for m in self._registry.models()}
        failed = {n for n in self._registry.names() if self._registry.state(n)[0] == "failed"}
        names = sorted(published | (failed & self._sources.keys()))
        outcomes: dict[str, ReloadOutcome] = {}

        def one(name: str) -> None:
            started = time.monotonic()
            try:
                result = self.reload(name)
            except Exception as exc:  # logged by reload(); the old version keeps serving
                if not isinstance(exc, WeightdError):
                    log.exception("reload of model %s failed", name)
                outcomes[name] = ReloadOutcome(name, False, str(exc), time.monotonic() - started)
                return
            ckpt = result.model.checkpoint
            detail = f"{count(len(ckpt.tensors), 'tensor')}, {ckpt.total_bytes} bytes"
            outcomes[name] = ReloadOutcome(name, True, detail, result.seconds)

        threads = [
            threading.Thread(target=one, args=(n,), name=f"weightd-reload-{i}", daemon=True)
            for i, n in enumerate(names)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [outcomes[n] for n in names if n in outcomes]


class _ReloadJob:
    """One reload's load running aside, and who decides its outcome (the first of: the
    load finishing, or its caller's deadline)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.cancel = threading.Event()
        self.finished = False
        self.abandoned = False
        self.error: BaseException | None = None
        self.result: ReloadResult | None = None
