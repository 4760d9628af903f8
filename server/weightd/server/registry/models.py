"""The models a daemon serves: loading (verify before publish) and the live registry."""

from __future__ import annotations

import gc
import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from weightd.common.digests import SLICE_DIGEST_ALGORITHM

from ..base.cleanup import on_error
from ..base.errors import (
    DataIntegrityError,
    InvalidRequest,
    ModelLoadFailed,
    ModelNotFound,
    ModelNotReady,
    echo,
)
from ..checkpoint.description import Checkpoint
from ..plan.builtin_rules import rules_for
from ..plan.layout import Layout
from ..plan.planner import RankPlan, plan
from ..plan.rules import ArchRules, RuleTable
from ..plan.slices import TensorSlice, peer_slices
from ..store.runs import RunPattern
from ..store.shards import ShardStore
from ..trust.integrity import SliceAnchors
from ..trust.manifest import FileDigest
from ..trust.verify import VerifyOptions, first_problem, verify_checkpoint

log = logging.getLogger("weightd.models")
MAX_CACHED_PLANS = 256


@dataclass
class LoadedModel:
    """A verified, open model. Immutable once published, except for being marked broken."""

    checkpoint: Checkpoint
    store: ShardStore
    rules: ArchRules | None
    tensor_digests: dict[str, str]
    anchors: SliceAnchors
    broken: str | None = None
    #: The ``--rules`` tables it was loaded with, so a reload applies the same rules.
    tables: tuple[RuleTable, ...] = ()
    _plans: dict[Layout, RankPlan] = field(default_factory=dict)
    #: Size and SHA-256 of every file read (config, index, shards), as verified.
    file_digests: dict[str, FileDigest] = field(default_factory=dict)
    #: What the checkpoint was checked against (a signed manifest, cache blob names).
    trust: tuple[str, ...] = ()
    #: Which trust root proved it, short (``Verification.trust_root``; "" none).
    trust_root: str = ""
    #: Why the files on disk no longer hold this version (a shard replaced or removed),
    #: while it keeps serving its verified, still-open files; None when they do.
    stale: str | None = None
    #: Its version number among the model's versions (``registry.versions``), set when
    #: it is published; 0 before.
    version: int = 0
    #: Published from a trainer's memory (a sealed memfd, :mod:`.memory`): no file on
    #: disk backs it, so the file watcher leaves it alone and a reload refuses it.
    from_memory: bool = False

    @property
    def name(self) -> str:
        return self.checkpoint.name

    @cached_property
    def fingerprint(self) -> str:
        """Identity of the served content: its config and every verified tensor digest.

        Names a Fetch stream (a resume must match it) and keys the shared-memory packs,
        so a reload with identical bytes keeps its packs and a changed model never reuses
        a stale one. Cached: it hashes every tensor's description, milliseconds for big
        models, and a published model never changes.
        """
        h = hashlib.sha256(self.checkpoint.config_json.encode())
        for t in self.checkpoint.tensors.values():
            h.update(f"\0{t.name}\0{t.dtype}\0{t.shape}\0{self.tensor_digests[t.name]}".encode())
        return h.hexdigest()

    def slice_anchor(
        self, s: TensorSlice, layout: Layout, kind: str = SLICE_DIGEST_ALGORITHM
    ) -> str:
        """The verified ``kind`` digest (SHA-256, BLAKE3) of slice ``s`` of the worker at layout.

        Every peer slice of its cut is anchored together (one read of the tensor proves
        each of them against the verified whole-tensor digest). The gRPC stream checks
        the bytes it sends against it and rank packs are verified against the same value,
        so both transports hand out digests with the same proof behind them.
        """
        tensor = self.checkpoint.tensors[s.name]
        if s.partition.count == 1:
            return self.anchors.get(tensor, s.partition.key, 0, lambda: [s.pattern], kind)

        def every_peer() -> list[RunPattern]:
            return [p.pattern for p in peer_slices(self.checkpoint, self.rules, s, layout)]

        return self.anchors.get(tensor, s.partition.key, s.partition.index, every_peer, kind)

    def plan(self, world_size: int, rank: int, names: tuple[str, ...] = ()) -> RankPlan:
        """The tensor-parallel-only shorthand of :meth:`plan_layout`."""
        return self.plan_layout(Layout.tp(world_size, rank), names)

    def plan_layout(self, layout: Layout, names: tuple[str, ...] = ()) -> RankPlan:
        if names:
            return plan(self.checkpoint, self.rules, layout, names)
        found = self._plans.get(layout)
        if found is None:
            found = plan(self.checkpoint, self.rules, layout)
            if len(self._plans) < MAX_CACHED_PLANS:  # layouts are client-chosen: bound them
                self._plans[layout] = found
        return found


#: Every state :func:`model_state` reports (a bounded metric label).
MODEL_STATES = ("loading", "ready", "stale", "broken", "failed")


def model_state(
    model: LoadedModel | None, loading: bool, failed: str | None = None
) -> tuple[str, str]:
    """(state, reason) of a registry entry (pure). Broken wins over stale: it serves nothing.

    ``failed``: why the model's load failed when no version of it was ever published
    (it serves nothing; the other models serve; a reload retries it)."""
    if model is None:
        if failed is not None and not loading:
            return "failed", failed
        return ("loading", "being verified") if loading else ("loading", "")
    if model.broken is not None:
        extra = f"; on disk: {model.stale}" if model.stale else ""
        return "broken", model.broken + extra
    if model.stale is not None:
        return "stale", model.stale
    return "ready", ""


def load_model(
    model_dir: str,
    name: str | None = None,
    tables: Sequence[RuleTable] = (),
    *,
    options: VerifyOptions | None = None,
) -> LoadedModel:
    """Open, parse, check and hash a checkpoint; the result is safe to publish.

    ``tables`` are the user's rules tables (``--rules``), tried before the built-ins.
    Every check of :func:`~weightd.server.trust.verify.verify_checkpoint` must pass (with
    ``options`` naming the trust sources and the hash cache); otherwise the first
    problem is raised, saying how many more there are, and nothing stays open.
    """
    v = verify_checkpoint(model_dir, name, options)
    store = v.store
    with on_error(store.close, f"the shard files of {model_dir}"):
        if v.checkpoint is None or v.problems:
            raise first_problem(v.problems, model_dir)
        ckpt = v.checkpoint
        rules = rules_for(ckpt.config, tables)
        digests = v.tensor_digests
    for line in v.trust:
        log.info("model %s matches %s", ckpt.name, line)
    return LoadedModel(
        ckpt,
        store,
        rules,
        digests,
        SliceAnchors(store, digests),
        tables=tuple(tables),
        file_digests=v.files,
        trust=tuple(v.trust),
        trust_root=v.trust_root,
    )


class ModelRegistry:
    """Name → model, with the states a client can observe (loading, ready, broken)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loading: set[str] = set()
        #: Models whose load failed before any version was published, and why.
        self._failed: dict[str, str] = {}
        self._models: dict[str, LoadedModel] = {}
        self._listeners: list[Callable[[str, bool], None]] = []
        self._publish_hooks: list[Callable[[LoadedModel], None]] = []

    def on_change(self, listener: Callable[[str, bool], None]) -> None:
        """Call ``listener(model_name, serving)`` whenever a model's readiness changes."""
        self._listeners.append(listener)

    def on_publish(self, hook: Callable[[LoadedModel], None]) -> None:
        """Call ``hook(model)`` under the registry's lock as each model is published, in
        publish order (versions are numbered there); it must be quick and never call
        back into the registry."""
        self._publish_hooks.append(hook)

    def _notify(self, name: str, serving: bool) -> None:
        for listener in self._listeners:
            listener(name, serving)

    def expect(self, name: str) -> None:
        with self._lock:
            self._loading.add(name)
        self._notify(name, False)

    def fail(self, name: str, reason: str) -> None:
        """``name``'s load failed and no version of it serves: state ``failed`` (ListModels,
        ``weightd_model_state``), Fetch answers FAILED_PRECONDITION with ``reason``. A
        model that has a published version keeps it (a failed reload changes nothing)."""
        with self._lock:
            self._loading.discard(name)
            if name in self._models:
                return
            self._failed[name] = reason
        self._notify(name, False)

    def publish(self, model: LoadedModel) -> None:
        with self._lock:
            old = self._models.get(model.name)
            for hook in self._publish_hooks:
                hook(model)
            self._models[model.name] = model
            self._loading.discard(model.name)
            self._failed.pop(model.name, None)
        if old is not None and old is not model:
            # Fetches still streaming from the old version hold references: its files
            # close when the last one lets go, not under their feet.
            weakref.finalize(old, old.store.close)
            alive = weakref.ref(old)
            del old
            if alive() is not None:
                # What must not hold it is garbage: a failed call's exception keeps its
                # traceback's frames (and the model they named) alive in a reference
                # cycle, and CPython runs a full cyclic pass only once the long-lived
                # objects have grown by a quarter, which a daemon's steady heap may
                # never do (racing reloads left 5-8 old versions' descriptors open, and
                # 30 clean reloads later still). One collection here frees just that
                # garbage and leaves what is really in use alone (then its last user
                # closes it); reloads are rare admin calls, the pass takes milliseconds.
                gc.collect()
        self._notify(model.name, model.broken is None)  # published broken: serves nothing

    def mark_broken(self, model: LoadedModel, reason: str) -> None:
        if model.broken is None:
            model.broken = reason
            log.error("model %s stops serving: %s", model.name, reason)
            with self._lock:
                current = self._models.get(model.name) is model
            if current:  # a replaced version breaking does not affect its successor
                self._notify(model.name, False)

    def mark_stale(self, model: LoadedModel, reason: str) -> None:
        """Record that ``model``'s files on disk differ from it; it keeps serving.

        Serving goes on because every byte it hands out is still its verified one
        (descriptors stay on the verified inodes); NOT_SERVING would take a host down
        in the middle of the documented publish flow (rename new shards into place,
        then reload). ListModels and ``weightd_model_state`` report it.
        """
        if model.stale != reason:
            model.stale = reason
            log.warning(
                "model %s: files on disk differ from the served version: %s", model.name, reason
            )

    def state(self, name: str) -> tuple[str, str]:
        """(state, reason) of ``name``: loading, ready, stale or broken, and why (pure read)."""
        with self._lock:
            model = self._models.get(name)
            loading = name in self._loading
            failed = self._failed.get(name)
        return model_state(model, loading, failed)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._loading | self._failed.keys() | self._models.keys())

    def models(self) -> list[LoadedModel]:
        with self._lock:
            return [self._models[n] for n in sorted(self._models)]

    def is_ready(self, name: str) -> bool:
        with self._lock:
            m = self._models.get(name)
        return m is not None and m.broken is None

    def get(self, name: str) -> LoadedModel:
        """The ready model called ``name`` (or the only model when ``name`` is empty)."""
        with self._lock:
            if not name:
                every = self._loading | self._failed.keys() | self._models.keys()
                if len(every) != 1:
                    raise InvalidRequest(
                        f"this daemon serves {len(every)} models ({', '.join(sorted(every))}); "
                        "name one"
                    )
                (name,) = every
            model = self._models.get(name)
            loading = name in self._loading
            failed = self._failed.get(name)
        if model is None:
            if loading:
                raise ModelNotReady(f"model {name!r} is still being verified", model=name)
            if failed is not None:
                raise ModelLoadFailed(
                    f"model {name!r} failed to load: {failed}; a reload retries it", model=name
                )
            raise ModelNotFound(
                f"model {echo(name)} is not served here (serving: {', '.join(self.names())})",
                model=name,
            )
        if model.broken is not None:
            raise DataIntegrityError(
                f"model {name!r} is not served until reloaded: {model.broken}", model=name
            )
        return model

    def close(self) -> None:
        with self._lock:
            models = list(self._models.values())
            self._models.clear()
        for m in models:
            m.store.close()
