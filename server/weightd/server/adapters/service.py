"""The adapter domain: what LoadAdapter, the pack side channel and FetchAdapter all ask for.

Names are checked, loads are verified against their base model and published through
the registry, and a version is planned for a rank, here, once. The gRPC servicer
(:mod:`weightd.server.rpc.adapters`) only converts messages and streams bytes; the
side channel (:mod:`weightd.server.transports`) leases versions and plans packs through
the same calls, so neither transport depends on the other.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from ..base.cleanup import release_frames
from ..base.errors import (
    AdapterConfigError,
    AdapterError,
    CheckpointError,
    InvalidRequest,
    echo,
)
from ..checkpoint.description import Checkpoint
from ..plan.layout import Layout
from ..registry.models import ModelRegistry
from ..sources.location import is_remote, parse_s3_uri
from ..sources.resolver import SourceResolver
from ..sources.s3 import RemoteObject
from .collector import AdapterMetrics
from .config import MAX_CONFIG_BYTES
from .load import (
    CONFIG_FILE,
    MAX_ADAPTER_BYTES,
    WEIGHTS_FILE,
    LoadedAdapter,
    load_adapter,
)
from .plan import AdapterSlicePlan, plan_adapter
from .registry import AdapterRegistry, AdapterVersion

MAX_ADAPTER_NAME_BYTES: Final = 256


@dataclass(frozen=True, slots=True)
class AdapterState:
    """A current version and how it is held: what ListAdapters and LoadAdapter report."""

    version: AdapterVersion
    pinned: bool = False
    leases: int = 0


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
    ) -> None:
        self.models = models
        self.registry = registry
        #: Local directory roots; ``s3://`` roots are kept apart (a local path can never
        #: resolve under one, nor an ``s3://`` source under a directory).
        self.roots = tuple(r for r in roots if not is_remote(r))
        self.remote_roots = tuple(parse_s3_uri(r) for r in roots if is_remote(r))
        self.resolver = resolver
        #: Load latency and rejections, when the daemon exports metrics.
        self.metrics: AdapterMetrics | None = None

    def load(
        self, name: str, model: str, source_dir: str, expected_digest: str
    ) -> AdapterState | None:
        """Verify the adapter in ``source_dir`` against ``model`` and publish it as ``name``.

        Returns its state now (None when a concurrent call already dropped it again).
        """
        started = time.monotonic()
        try:
            state = self._load(name, model, source_dir, expected_digest)
        except Exception as exc:
            # The frames a failed load unwound through held what it read (up to the whole
            # weights file); clear them so the memory returns when the call ends.
            release_frames(exc)
            if self.metrics is not None:
                self.metrics.rejected(exc)
            raise
        if self.metrics is not None:
            self.metrics.published(time.monotonic() - started)
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

        loader = lambda: load_adapter(source_dir, roots, base, expected, room)  # noqa: E731
        if is_remote(source_dir):
            loader = self._remote_loader(source_dir, base, expected, room)
        registry.load(name, f"{base.name}\0{source_dir}", expected, loader)
        return self.state(name)

    def _remote_loader(
        self,
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
            resolved = resolver.resolve_adapter(source, remote_roots, expected, admit)
            root = os.path.dirname(resolved.directory)
            try:
                adapter = load_adapter(resolved.directory, [root], base, expected, room)
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
