"""The adapter domain: what LoadAdapter, the pack side channel and FetchAdapter all ask for.

Names are checked, loads are verified against their base model and published through
the registry, and a version is planned for a rank, here, once. The gRPC servicer
(:mod:`weightd.server.rpc.adapters`) only converts messages and streams bytes; the
side channel (:mod:`weightd.server.transports`) holds versions and plans packs through
the same calls, so neither transport depends on the other.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Final

from ..base.cleanup import release_frames
from ..base.errors import (
    AdapterBaseMismatch,
    AdapterConfigError,
    AdapterError,
    AdapterLoadPending,
    AdapterNotFound,
    CheckpointError,
    InvalidRequest,
    MissingFileError,
    ObjectNotFound,
    echo,
)
from ..checkpoint.description import Checkpoint
from ..plan.layout import Layout
from ..registry.models import ModelRegistry
from ..sources.location import is_remote, parse_s3_uri
from ..sources.resolver import SourceResolver
from ..sources.s3 import RemoteObject
from ..telemetry import logs
from ..trust.oms import OmsStatement, require_signed
from .autoload import AutoloadPolicy
from .collector import AdapterMetrics, rejection_reason
from .config import MAX_CONFIG_BYTES
from .load import (
    CONFIG_FILE,
    MAX_ADAPTER_BYTES,
    WEIGHTS_FILE,
    LoadedAdapter,
    load_adapter,
    open_source,
)
from .plan import AdapterSlicePlan, plan_adapter
from .registry import AdapterEvent, AdapterRegistry, AdapterVersion

#: What an ``AdapterLoadPending`` refusal tells a person; clients act on its reason
#: (the error's class), never on these words.
ASK_AGAIN: Final = "ask again shortly"
MAX_ADAPTER_NAME_BYTES: Final = 256
#: Longest a ResolveAdapter waits on a server thread for another call's load.
AUTOLOAD_WAIT_SECONDS: Final = 2.0


@dataclass(frozen=True, slots=True)
class AdapterState:
    """A current version and how it is held: what ListAdapters and LoadAdapter report."""

    version: AdapterVersion
    pinned: bool = False
    #: Fetches and packs holding the version (``AdapterStatus.leases`` on the wire).
    holds: int = 0


def check_name(name: str) -> None:
    if not name:
        raise InvalidRequest("adapter name is empty")
    if len(name.encode()) > MAX_ADAPTER_NAME_BYTES or not name.isprintable():
        raise InvalidRequest(
            f"adapter name {name[:64]!r} must be printable and at most "
            f"{MAX_ADAPTER_NAME_BYTES} bytes"
        )


def check_tp_only(layout: Layout) -> None:
    if layout.pp_size > 1 or layout.ep_size > 1:
        raise InvalidRequest("adapters are served for tensor parallelism only")
    if layout.vocab_pad:
        # Adapter slices follow the base rules' equal blocks; an adapter on a padded
        # vocabulary would otherwise arrive cut differently from what was asked.
        raise InvalidRequest(
            f"vocab_pad {layout.vocab_pad}: adapters are cut in equal blocks only (vocab_pad 0)"
        )


def naming(exc: CheckpointError, directory: str, uri: str) -> CheckpointError:
    """``exc`` naming the ``s3://`` object ``uri`` holds instead of its cache copy under
    ``directory`` (the same class, code and problem): an operator fixes the bucket."""
    path = exc.path
    if path == directory or path.startswith(directory + os.sep):
        rest = os.path.relpath(path, directory)
        path = uri if rest == "." else uri + rest
    cls = type(exc)
    out = cls.__new__(cls)
    out.__dict__.update(exc.__dict__)
    out.path = path
    out.message = f"{path}: {exc.problem}"
    Exception.__init__(out, out.message)
    return out


class AdapterService:
    """The registries and the configured roots, behind the operations both edges need."""

    def __init__(
        self,
        models: ModelRegistry,
        registry: AdapterRegistry,
        roots: Sequence[str],
        *,
        resolver: SourceResolver | None = None,
        autoload: AutoloadPolicy | None = None,
        autoload_slots: int = 4,
    ) -> None:
        self.models = models
        self.registry = registry
        #: Loads a worker may trigger by naming an adapter (ResolveAdapter with load).
        self.autoload = autoload or AutoloadPolicy()
        self._lock = threading.Lock()
        #: One load on request per name at a time; later callers wait for its outcome.
        self._autoloading: dict[str, Future[AdapterState]] = {}
        #: Server threads a load on request may hold: as many loading, as many waiting.
        #: Each holds one of the worker listener's threads, so they are bounded (and a
        #: waiter waits at most AUTOLOAD_WAIT_SECONDS): health and fetches keep theirs.
        self._loaders = threading.BoundedSemaphore(autoload_slots)
        self._waiters = threading.BoundedSemaphore(autoload_slots)
        registry.on_event(_log_event)
        #: Called with each version a load published, on the load's thread, before the
        #: load answers (the side socket builds the version's TP=1 pack there).
        self._on_loaded: list[Callable[[AdapterVersion], None]] = []
        #: Local directory roots; ``s3://`` roots are kept apart (a local path can never
        #: resolve under one, nor an ``s3://`` source under a directory).
        self.roots = tuple(r for r in roots if not is_remote(r))
        self.remote_roots = tuple(parse_s3_uri(r) for r in roots if is_remote(r))
        self.resolver = resolver
        #: Load latency and rejections, when the daemon exports metrics.
        self.metrics: AdapterMetrics | None = None

    def load(
        self, name: str, model: str, source_dir: str, expected_digest: str, *, by: str = "admin"
    ) -> AdapterState | None:
        """Verify the adapter in ``source_dir`` against ``model`` and publish it as ``name``.

        Returns its state now (None when a concurrent call already dropped it again).
        ``by`` says who asked ("admin", or "worker" for a load on request), for the log.
        """
        return self._timed_load(name, model, source_dir, expected_digest, by, None)

    def _timed_load(
        self,
        name: str,
        model: str,
        source: str,
        expected: str,
        by: str,
        absent: type[Exception] | None,
    ) -> AdapterState | None:
        """:meth:`load`; an ``absent`` error (the source is not there) is raised uncounted."""
        started = time.monotonic()
        try:
            state = self._load(name, model, source, expected)
        except Exception as exc:
            if absent is not None and isinstance(exc, absent):
                release_frames(exc)
                raise
            self._refused(name, source, exc, by)
            raise
        if self.metrics is not None:
            self.metrics.published(time.monotonic() - started)
        return state

    def _refused(self, name: str, source: str, exc: Exception, by: str) -> None:
        # The frames a failed load unwound through held what it read (up to the whole
        # weights file); clear them so the memory returns when the call ends.
        release_frames(exc)
        if self.metrics is not None:
            self.metrics.rejected(exc)
        logs.event(
            "adapter",
            logging.WARNING,
            action="refuse",
            adapter=name,
            source=source,
            by=by,
            reason=rejection_reason(exc),
            error=str(exc),
        )

    # --- loads on a worker's request -------------------------------------------------

    def resolve(self, name: str, model: str, load: bool) -> AdapterState:
        """The current version of ``name``; with ``load``, loaded on request first when it
        is not loaded and the operator allows it (:mod:`.autoload`). Concurrent calls for
        one name share one load: the daemon reads and verifies it once."""
        outcome = "refused"
        try:
            check_name(name)
            state = self.state(name)
            outcome = "held"
            if state is None and load:
                outcome = "loaded"
                state = self._autoload_once(name, model)
            if state is None:
                outcome = "not_found"
                raise AdapterNotFound(f"adapter {echo(name)} is not loaded")
            self._check_base(state, model)
            return state
        except AdapterNotFound:
            outcome = "not_found"
            raise
        except Exception:
            outcome = "refused"
            raise
        finally:
            if self.metrics is not None:
                self.metrics.resolved(outcome)

    def _check_base(self, state: AdapterState, model: str) -> None:
        adapter = state.version.adapter
        served = self.models.get(model).name if model else adapter.base_model
        if served != adapter.base_model:
            raise AdapterBaseMismatch(
                adapter.source,
                f"adapter {echo(state.version.name)} is loaded for model "
                f"{adapter.base_model!r}, not {served!r}",
            )

    def _autoload_once(self, name: str, model: str) -> AdapterState | None:
        with self._lock:
            pending = self._autoloading.get(name)
            owner = pending is None
            if pending is None:
                if not self._loaders.acquire(blocking=False):
                    raise AdapterLoadPending(
                        f"adapter {echo(name)}: the daemon is loading as many adapters on "
                        f"request as it may at once; {ASK_AGAIN}"
                    )
                pending = Future()
                self._autoloading[name] = pending
        if not owner:
            try:
                return self._wait(name, pending)
            finally:
                del pending  # its exception's traceback holds this frame (see registry.load)
        try:
            # A load that finished between our look and taking the slot: use it.
            state = self.state(name) or self._autoload(name, model)
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        else:
            pending.set_result(state)
            return state
        finally:
            with self._lock:
                del self._autoloading[name]
            self._loaders.release()
            del pending

    def _wait(self, name: str, pending: Future[AdapterState]) -> AdapterState:
        """Another call's load of ``name``, waited for a bounded time on a bounded number
        of threads; past either the caller asks again."""
        if not self._waiters.acquire(blocking=False):
            raise AdapterLoadPending(f"adapter {echo(name)} is being loaded; {ASK_AGAIN}")
        try:
            return pending.result(timeout=AUTOLOAD_WAIT_SECONDS)
        except FutureTimeout:
            raise AdapterLoadPending(
                f"adapter {echo(name)} is still being loaded; {ASK_AGAIN}"
            ) from None
        finally:
            self._waiters.release()

    def _autoload(self, name: str, model: str) -> AdapterState:
        """Load ``name`` from directly under the first root that has it (local roots
        first). Nothing is read for a name the operator did not allow; for an allowed
        one, whether it exists is looked up (a directory, or one HEAD) before asking
        what vouches for it, so an unknown name is NOT_FOUND."""
        self.autoload.check_allowed(name)
        source = self._find(name)
        expected = self.autoload.expected_digest(name) or ""
        absent = ObjectNotFound if is_remote(source) else None
        try:
            return self._loaded(
                self._timed_load(name, model, source, expected, "worker", absent), name
            )
        except ObjectNotFound as exc:  # removed from the bucket since we looked
            raise AdapterNotFound(f"adapter {echo(name)}: {exc}") from None

    def _find(self, name: str) -> str:
        """The source of ``name`` directly under the first root that has it."""
        if self.roots:
            try:
                open_source(name, self.roots).close()
            except MissingFileError:
                pass
            else:
                return name
        resolver = self.resolver
        for root in self.remote_roots:
            source = root.child(name).uri
            if resolver is not None and resolver.adapter_present(source, self.remote_roots):
                return source
        where = ", ".join([*self.roots, *(r.uri for r in self.remote_roots)]) or "none configured"
        raise AdapterNotFound(
            f"adapter {echo(name)} is not loaded and is under no adapter root ({where})"
        )

    @staticmethod
    def _loaded(state: AdapterState | None, name: str) -> AdapterState:
        if state is None:  # unloaded again by an operator before we could look
            raise AdapterNotFound(f"adapter {echo(name)} was unloaded while it was loading")
        return state

    def _load(
        self, name: str, model: str, source_dir: str, expected_digest: str
    ) -> AdapterState | None:
        check_name(name)
        if not source_dir:
            raise InvalidRequest("source_dir is empty")
        base = self.models.get(model).checkpoint
        expected = expected_digest or None
        roots, registry = self.roots, self.registry

        def room(n: int) -> None:
            registry.check_room(name, n)

        def loader() -> LoadedAdapter:
            statement = self._signed(name)
            adapter = load_adapter(source_dir, roots, base, expected, room)
            if statement is not None:
                require_signed(statement, adapter.source, adapter.file_sha256)
            return adapter

        if is_remote(source_dir):
            loader = self._remote_loader(name, source_dir, base, expected, room)
        version = registry.load(name, f"{base.name}\0{source_dir}", expected, loader)
        for callback in self._on_loaded:
            callback(version)
        return self.state(name)

    def on_loaded(self, callback: Callable[[AdapterVersion], None]) -> None:
        """Call ``callback(version)`` after each load, before it answers; it must not raise
        for a reason the load's caller should see (the load has succeeded)."""
        self._on_loaded.append(callback)

    def _signed(self, name: str) -> OmsStatement | None:
        """The adapter's OMS signature (``--adapter-signature NAME=FILE``), verified
        before any adapter byte is read; None when it has none."""
        found = self.resolver.signature(name, adapter=True) if self.resolver else None
        return found[0] if found is not None else None

    def _remote_loader(
        self,
        name: str,
        source: str,
        base: Checkpoint,
        expected: str | None,
        room: Callable[[int], None],
    ) -> Callable[[], LoadedAdapter]:
        """Download (or find cached) the ``s3://`` adapter, then load it as a local one.

        The sizes the store gives are judged against every limit and the budget before
        the first GET (as a local adapter's are before it is read); a version that fails
        its checks is removed from the cache, and its errors name the ``s3://`` object,
        not the cache directory."""
        resolver = self.resolver
        if resolver is None:
            raise InvalidRequest(f"{echo(source)}: this daemon has no remote sources configured")
        remote_roots = self.remote_roots
        uri = source if source.endswith("/") else source + "/"

        def admit(objects: Sequence[RemoteObject]) -> None:
            sizes = {o.name: o.size for o in objects}
            config, weights = sizes[CONFIG_FILE], sizes[WEIGHTS_FILE]
            if config > MAX_CONFIG_BYTES:
                raise AdapterConfigError(
                    uri + CONFIG_FILE,
                    f"{config} bytes in the store, over the {MAX_CONFIG_BYTES}-byte limit; "
                    "not downloaded",
                )
            if weights > MAX_ADAPTER_BYTES:
                raise AdapterError(
                    uri + WEIGHTS_FILE,
                    f"{weights} bytes in the store, over the {MAX_ADAPTER_BYTES}-byte limit; "
                    "not downloaded",
                )
            room(config + weights)

        def load() -> LoadedAdapter:
            statement = self._signed(name)
            resolved = resolver.resolve_adapter(source, remote_roots, expected, admit, statement)
            root = os.path.dirname(resolved.directory)
            try:
                adapter = load_adapter(resolved.directory, [root], base, expected, room)
                if statement is not None:
                    require_signed(statement, adapter.source, adapter.file_sha256)
            except BaseException as exc:
                resolver.reject(resolved.directory)
                if isinstance(exc, CheckpointError):
                    raise naming(exc, resolved.directory, uri) from None
                raise
            resolver.accept(uri, resolved.directory)
            return adapter

        return load

    def unload(self, name: str) -> AdapterVersion:
        check_name(name)
        return self.registry.unload(name)

    def set_pinned(self, name: str, pinned: bool) -> AdapterState | None:
        check_name(name)
        self.registry.set_pinned(name, pinned)
        return self.state(name)

    def current(self) -> list[AdapterState]:
        return [AdapterState(v, p, n) for v, p, n in self.registry.current()]

    def state(self, name: str) -> AdapterState | None:
        """The current version of ``name`` and how it is held; None when it has none."""
        for s in self.current():
            if s.version.name == name:
                return s
        return None

    def plan(self, v: AdapterVersion, layout: Layout) -> AdapterSlicePlan:
        """Which slices of version ``v`` the worker at ``layout`` receives."""
        check_tp_only(layout)
        model = self.models.get(v.adapter.base_model)
        return plan_adapter(
            v.adapter.modules, model.checkpoint, model.rules, layout.tp_size, layout.tp_rank
        )


_ACTIONS: Final = {"load": "load", "replace": "replace", "unloaded": "unload", "evicted": "evict"}


def _log_event(e: AdapterEvent) -> None:
    """One line per published change (called under the registry lock: one log call)."""
    logs.event(
        "adapter",
        action=_ACTIONS.get(e.reason or e.kind, e.kind),
        adapter=e.name,
        version=e.version,
        digest=e.digest,
        source=e.source,
    )
