"""Model versions: each one an engine may still move to, and the holds that keep it.

The registry serves one model per name and swaps in a new one atomically (a reload, a
trainer's publish, a restore); a fetch already streaming keeps the object it started
from. An engine that moves to a new version needs more: its ranks fetch their shares
one after the other, and a reload between two of them must not leave the last rank
without the version the first one took. So here:

* every published model gets a **version number**, increasing per model name over the
  daemon's life; a publish of identical content (same fingerprint) keeps its number,
  so a reload that changed nothing announces nothing;
* the current version is always held; an older one stays held while a **hold**
  (``HoldVersion``: a holder, a TTL) names it, and is **dropped** when its last hold
  ends or expires: its files then close when the last fetch streaming it lets go;
* ``resolve(name, version)`` is what Fetch, DescribeModel and the side channel use: a
  version no longer held is :class:`~weightd.server.base.errors.VersionNotHeld`;
* every change is an **event** (ready, dropped) delivered in order to each watcher,
  which first receives the current version of every model as ready.

Holds expire by TTL rather than by a connection: a hold costs the daemon no thread,
and a holder that dies lets go when its TTL passes (the engine asks for a TTL that
covers its update). Expiry is checked on every call and by the watch loop's poll.

What a client can make the daemon keep is bounded (:class:`HoldBounds`, the
``[versions]`` settings), and a hold is never refused for want of room, so no client
can stop an engine from holding the version it needs:

* **old versions**: at most ``max_old`` versions of a model besides the current one
  stay held; a publish that would keep more drops the oldest, holds and all (its
  checkpoint files and packs are what a hold really costs). An engine holds the
  newest versions, so the versions a hoarder keeps are the first to go;
* **holds per client**: a *client* is what the holder cannot forge in a request (the
  holder string is its own choice): the connection's peer as the RPC edge sees it
  (:func:`weightd.server.rpc.peers.client_of`). A client past ``max_holds_per_client``
  gets its hold, and its own oldest hold ends;
* **holds in all**: past ``max_holds``, the oldest hold of the client holding the
  most ends; a client with few holds is never the one cut.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

from ..base.errors import (
    DataIntegrityError,
    InvalidRequest,
    VersionNotHeld,
    echo,
)
from .holdbounds import HoldBounds
from .models import LoadedModel, ModelRegistry

log = logging.getLogger("weightd.versions")

DEFAULT_HOLD_SECONDS: Final = 600.0
#: Events a slow watcher may fall behind by before it is cut off (it must watch again).
MAX_PENDING_EVENTS: Final = 1024


@dataclass(frozen=True, slots=True)
class VersionInfo:
    model: str
    version: int
    fingerprint: str
    total_bytes: int
    num_tensors: int
    architecture: str
    source: str

    @classmethod
    def of(cls, model: LoadedModel) -> VersionInfo:
        ckpt = model.checkpoint
        return cls(
            model.name,
            model.version,
            model.fingerprint,
            ckpt.total_bytes,
            len(ckpt.tensors),
            ckpt.architecture,
            ckpt.root,
        )


@dataclass(frozen=True, slots=True)
class VersionEvent:
    kind: str  # "ready" | "dropped"
    info: VersionInfo


@dataclass(frozen=True, slots=True)
class Hold:
    hold_id: str
    model: str
    version: int
    holder: str
    expires: float
    ttl: float
    client: str = ""


@dataclass
class _Entry:
    model: LoadedModel
    info: VersionInfo
    holds: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class HeldVersion:
    """What the metrics read of one held version."""

    model: str
    version: int
    current: bool
    holds: int
    engines: int  # distinct holders
    total_bytes: int = 0


class VersionWatch:
    """An ordered stream of version events for one watcher; ``close`` ends it."""

    def __init__(self, versions: ModelVersions, model: str) -> None:
        self._versions = versions
        self.model = model
        self._queue: queue.Queue[VersionEvent | None] = queue.Queue(MAX_PENDING_EVENTS)
        self.overflowed = False

    def _put(self, event: VersionEvent) -> None:
        if self.model and event.info.model != self.model:
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.overflowed = True
            self._versions._watches.discard(self)

    def next(self, timeout: float | None = None) -> VersionEvent | None:
        """The next event; None on timeout, or once closed or overflowed."""
        self._versions.expire()
        if self.overflowed and self._queue.empty():
            return None
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        with self._versions._lock:
            self._versions._watches.discard(self)
        self._queue.put(None)


class ModelVersions:
    """Every version still held, per model; see the module docstring.

    Attach with :meth:`attach`: it numbers each model the registry publishes, under
    the registry's lock, so numbers follow the publish order.
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, bounds: HoldBounds | None = None
    ) -> None:
        self._clock = clock
        self.bounds = bounds or HoldBounds()
        #: Holds ended to make room, and held versions dropped past ``max_old``.
        self.holds_evicted = 0
        self.versions_evicted = 0
        self._lock = threading.Lock()
        self._entries: dict[str, dict[int, _Entry]] = {}
        self._current: dict[str, int] = {}
        self._numbers: dict[str, Iterator[int]] = {}
        self._holds: dict[str, Hold] = {}
        self._watches: set[VersionWatch] = set()
        self._on_drop: list[Callable[[VersionInfo], None]] = []
        self._dropped: list[VersionInfo] = []

    def attach(self, registry: ModelRegistry) -> None:
        self._registry = registry
        registry.on_publish(self._published)

    # --- publishing (the registry's hook) ----------------------------------------------

    def _published(self, model: LoadedModel) -> None:
        """Number ``model`` and make it current; called under the registry's lock."""
        name = model.name
        with self._lock:
            versions = self._entries.setdefault(name, {})
            current = versions.get(self._current.get(name, 0))
            if current is not None and current.info.fingerprint == model.fingerprint:
                model.version = current.info.version  # same content: same version
                current.model = model  # the fresh object (e.g. no longer broken)
                return
            numbers = self._numbers.setdefault(name, itertools.count(1))
            model.version = next(numbers)
            info = VersionInfo.of(model)
            versions[model.version] = _Entry(model, info)
            self._current[name] = model.version
            self._emit(VersionEvent("ready", info))
            if current is not None:
                self._maybe_drop(current)
            self._drop_past_bound(name)
        log.info("model %s version %d ready (%s)", name, model.version, model.fingerprint[:16])

    # --- resolving -------------------------------------------------------------------------

    def resolve(self, name: str, version: int) -> LoadedModel:
        """The model ``name`` at ``version`` (0: the current one), ready to serve.

        Raises what ``registry.get`` raises for the model, :class:`VersionNotHeld` for a
        version no longer held, :class:`DataIntegrityError` for a broken one.
        """
        try:
            current: LoadedModel | None = self._registry.get(name)
        except DataIntegrityError:
            if not version:
                raise
            current = None  # the current version is broken; an older held one may serve
            name = name or self._only_name()
        if current is not None and version in (0, current.version):
            return current
        name = current.name if current is not None else name
        self.expire()
        with self._lock:
            entry = self._entries.get(name, {}).get(version)
            if entry is None:
                raise self._not_held(name, version)
            model = entry.model
        if model.broken is not None:
            raise DataIntegrityError(
                f"model {model.name!r} version {version} is not served: {model.broken}"
            )
        return model

    def _only_name(self) -> str:
        """The daemon's only model (what an empty name means); the registry raised for it
        already if there is not exactly one."""
        names = self._registry.names()
        return names[0] if len(names) == 1 else ""

    def _not_held(self, name: str, version: int) -> VersionNotHeld:
        held = sorted(self._entries.get(name, {}))
        return VersionNotHeld(
            f"model {name!r} version {version} is not held by this daemon (held: "
            f"{', '.join(map(str, held)) or 'none'}; current: {self._current.get(name, 0)})"
        )

    # --- holds -----------------------------------------------------------------------------

    def hold(
        self, name: str, version: int, holder: str, ttl: float, client: str = ""
    ) -> tuple[Hold, VersionInfo]:
        """Keep ``version`` of ``name`` (0: the current one) for ``ttl`` seconds at most.

        ``client``: who asks, as the RPC edge identified the connection (not the
        holder string). Never refused for want of room: past a bound, the hold that
        ends is the asking client's oldest, or the biggest holder's (module docstring).
        """
        if ttl <= 0:
            ttl = DEFAULT_HOLD_SECONDS
        ttl = min(ttl, self.bounds.max_hold_seconds)
        model = self.resolve(name, version)
        self.expire()
        with self._lock:
            self._make_room_locked(client)
            entry = self._entries.get(model.name, {}).get(model.version)
            if entry is None:  # dropped between resolve and now (or to make room)
                raise self._not_held(model.name, model.version)
            hold = Hold(
                secrets.token_hex(16),
                model.name,
                model.version,
                holder,
                self._clock() + ttl,
                ttl,
                client,
            )
            self._holds[hold.hold_id] = hold
            entry.holds.add(hold.hold_id)
            info = entry.info
        self._notify_dropped()
        log.info(
            "model %s version %d held by %s (client %s) for at most %.0fs",
            model.name,
            model.version,
            echo(holder) if holder else "(anonymous)",
            echo(client) if client else "(local)",
            ttl,
        )
        return hold, info

    def _make_room_locked(self, client: str) -> None:
        """End holds so one more by ``client`` stays within the bounds (under the lock).

        Holds are in insertion order, so the first of a client's is its oldest.
        """
        mine = [h for h in self._holds.values() if h.client == client]
        if len(mine) >= self.bounds.max_holds_per_client:
            self._evict_locked(mine[0], f"client {echo(client)} holds {len(mine)}")
        if len(self._holds) < self.bounds.max_holds:
            return
        per_client: dict[str, list[Hold]] = {}
        for h in self._holds.values():
            per_client.setdefault(h.client, []).append(h)
        biggest = max(per_client.values(), key=len)
        self._evict_locked(biggest[0], f"{len(self._holds)} holds are outstanding in all")

    def _evict_locked(self, hold: Hold, why: str) -> None:
        del self._holds[hold.hold_id]
        self.holds_evicted += 1
        log.warning(
            "model %s version %d: hold by %s ended early to make room (%s)",
            hold.model,
            hold.version,
            echo(hold.holder) if hold.holder else "(anonymous)",
            why,
        )
        self._unhold_locked(hold)

    def _drop_past_bound(self, name: str) -> None:
        """Drop ``name``'s oldest held versions past ``max_old`` (under the lock)."""
        versions = self._entries.get(name, {})
        current = self._current.get(name)
        old = sorted(n for n in versions if n != current)
        for number in old[: max(0, len(old) - self.bounds.max_old)]:
            entry = versions[number]
            for hold_id in list(entry.holds):
                self._holds.pop(hold_id, None)
            log.warning(
                "model %s version %d dropped with %d hold(s) left: more than %d older "
                "versions would stay held",
                name,
                number,
                len(entry.holds),
                self.bounds.max_old,
            )
            entry.holds.clear()
            self.versions_evicted += 1
            self._maybe_drop(entry)

    def release(self, hold_id: str) -> bool:
        """End a hold; False when there is none by that id (released, expired)."""
        if not hold_id:
            raise InvalidRequest("ReleaseVersion names no hold_id")
        with self._lock:
            hold = self._holds.pop(hold_id, None)
            if hold is not None:
                self._unhold_locked(hold)
        self._notify_dropped()
        return hold is not None

    def expire(self) -> int:
        """End every hold whose TTL passed; returns how many."""
        now = self._clock()
        with self._lock:
            gone = [h for h in self._holds.values() if h.expires <= now]
            for hold in gone:
                del self._holds[hold.hold_id]
                log.warning(
                    "model %s version %d: hold by %s expired after %.0fs without a release",
                    hold.model,
                    hold.version,
                    echo(hold.holder) if hold.holder else "(anonymous)",
                    hold.ttl,
                )
                self._unhold_locked(hold)
        self._notify_dropped()  # also what a publish dropped (under the registry's lock)
        return len(gone)

    def _unhold_locked(self, hold: Hold) -> None:
        entry = self._entries.get(hold.model, {}).get(hold.version)
        if entry is not None:
            entry.holds.discard(hold.hold_id)
            self._maybe_drop(entry)

    def _maybe_drop(self, entry: _Entry) -> None:
        """Drop ``entry`` if it is neither current nor held (under the lock)."""
        info = entry.info
        if entry.holds or self._current.get(info.model) == info.version:
            return
        del self._entries[info.model][info.version]
        self._emit(VersionEvent("dropped", info))
        self._dropped.append(info)
        log.info("model %s version %d dropped (no hold left)", info.model, info.version)

    # --- observers -------------------------------------------------------------------------

    def on_drop(self, callback: Callable[[VersionInfo], None]) -> None:
        """Call ``callback(info)`` (outside the lock) when a version is let go."""
        self._on_drop.append(callback)

    def _notify_dropped(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for info in dropped:
            for callback in self._on_drop:
                callback(info)

    def _emit(self, event: VersionEvent) -> None:
        for w in list(self._watches):
            w._put(event)

    def watch(self, model: str = "") -> VersionWatch:
        """A watcher of ``model`` (empty: every model): first each current version as
        ready, then every event in order."""
        w = VersionWatch(self, model)
        with self._lock:
            for name, number in sorted(self._current.items()):
                w._put(VersionEvent("ready", self._entries[name][number].info))
            self._watches.add(w)
        return w

    def held(self) -> list[HeldVersion]:
        """Every held version, for the metrics (expired holds are ended first)."""
        self.expire()
        with self._lock:
            out = []
            for name, versions in sorted(self._entries.items()):
                for number, entry in sorted(versions.items()):
                    holders = {self._holds[h].holder for h in entry.holds if h in self._holds}
                    out.append(
                        HeldVersion(
                            name,
                            number,
                            self._current.get(name) == number,
                            len(entry.holds),
                            len(holders),
                            entry.info.total_bytes,
                        )
                    )
            return out

    def evictions(self) -> tuple[int, int]:
        """``(holds ended early, held versions dropped)`` past the bounds, for the metrics."""
        with self._lock:
            return self.holds_evicted, self.versions_evicted

    def info(self, name: str, version: int) -> VersionInfo | None:
        with self._lock:
            entry = self._entries.get(name, {}).get(version)
            return entry.info if entry is not None else None

    def models_of(self, name: str) -> list[LoadedModel]:
        """Every held version of ``name``, oldest first."""
        with self._lock:
            return [e.model for _, e in sorted(self._entries.get(name, {}).items())]

    def close(self) -> None:
        """End every watch (daemon shutdown)."""
        with self._lock:
            watches = list(self._watches)
        for w in watches:
            w.close()
