"""The adapter registry: immutable versions, atomic replace, holds, LRU budget, events.

Engines keep adapters inside themselves, and that is where their races live (an
adapter unloaded while a request still uses it, a replace seen half-way). Here:

* a **version** never changes once published; load and replace publish a new one by
  swapping one reference under a lock, so a reader sees the old or the new, whole;
* a **hold** pins the version a fetch started on: unload or replace retire the
  version, but its bytes stay until the last hold is released;
* a **budget** bounds the bytes held; to fit a new adapter, unheld and unpinned
  adapters are evicted least recently used first, and if that is not enough the load
  fails and nothing is evicted;
* concurrent loads of the same name and source **coalesce** into one read;
* every change is an **event** (load, replace, unload) with the version, delivered in
  order to every watcher, which first receives the current adapters as loads.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Final

from weightd.common.watch import EventQueue

from ..base.cleanup import release_frames
from ..base.errors import AdapterBudgetExhausted, AdapterNotFound
from .load import LoadedAdapter

#: Events a slow watcher may fall behind by before it is cut off (it must re-watch).
MAX_PENDING_EVENTS: Final = 4096


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    name: str
    version: int
    adapter: LoadedAdapter


@dataclass(frozen=True, slots=True)
class AdapterEvent:
    kind: str  # "load" | "replace" | "unload"
    name: str
    version: int
    digest: str
    reason: str = ""  # for unload: "unloaded" or "evicted"
    source: str = ""  # where the version was read from (the real path), for logs


@dataclass
class _Entry:
    current: AdapterVersion
    pinned: bool = False
    last_used: int = 0


@dataclass
class _Held:
    version: AdapterVersion
    #: Fetches and packs holding this version (``AdapterStatus.leases`` on the wire).
    holds: int = 0
    retired: bool = False


class AdapterHold:
    """A version held for one fetch or pack; release exactly once (also via ``with``).

    "Hold", as for model versions (``HoldVersion``): what keeps a version in the daemon.
    A lease is a connection's claim on a pack's memory (``packs/cache.py``); an adapter
    pack's lease comes with a hold on its version (``packing.AdapterPackLease``).
    """

    def __init__(self, registry: AdapterRegistry, version: AdapterVersion) -> None:
        self._registry = registry
        self.version = version
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._registry._release(self.version)

    def __enter__(self) -> AdapterVersion:
        return self.version

    def __exit__(self, *exc: object) -> None:
        self.release()


class Watch(EventQueue[AdapterEvent]):
    """An ordered stream of adapter events for one watcher; ``close`` ends it."""

    def __init__(self, registry: AdapterRegistry) -> None:
        super().__init__(MAX_PENDING_EVENTS, lambda: registry._unwatch(self))
        self._registry = registry

    def __iter__(self) -> Iterator[AdapterEvent]:
        while (event := self.next()) is not None:
            yield event

    def close(self) -> None:
        with self._registry._lock:
            self._registry._unwatch(self)
        super().close()


@dataclass
class AdapterRegistry:
    budget_bytes: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _held: dict[tuple[str, int], _Held] = field(default_factory=dict)
    _loading: dict[tuple[str, str, str | None], Future[AdapterVersion]] = field(
        default_factory=dict
    )
    _watches: list[Watch] = field(default_factory=list)
    _versions: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _clock: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    #: Called (outside the lock) with (name, version) when a version's bytes are let go:
    #: retired and unheld. Packs built from it are freed then (see adapters.packs).
    _on_drop: list[Callable[[str, int], None]] = field(default_factory=list)
    #: Called under the lock with every event, in order (metrics count them).
    _on_event: list[Callable[[AdapterEvent], None]] = field(default_factory=list)
    _dropped: list[tuple[str, int]] = field(default_factory=list)

    # --- loading ------------------------------------------------------------------

    def load(
        self,
        name: str,
        source: str,
        expected_digest: str | None,
        read: Callable[[], LoadedAdapter],
    ) -> AdapterVersion:
        """Read (via ``read``) and publish ``name``; concurrent identical loads share one read.

        A failed read publishes nothing and leaves the current version serving.
        """
        key = (name, source, expected_digest)
        with self._lock:
            pending = self._loading.get(key)
            owner = pending is None
            if pending is None:
                pending = Future()
                self._loading[key] = pending
        # A failed read's exception is held by the future, whose traceback holds this
        # frame, which holds the future: ``del pending`` breaks that cycle, so what the
        # read held is freed when the call ends, not at the next garbage collection.
        if not owner:
            try:
                return pending.result()
            finally:
                del pending
        try:
            version = self._publish(name, read())
        except BaseException as exc:
            release_frames(exc)  # the read's frames: the bytes it had read
            pending.set_exception(exc)
            raise
        else:
            pending.set_result(version)
            return version
        finally:
            with self._lock:
                del self._loading[key]
            del pending

    def _publish(self, name: str, adapter: LoadedAdapter) -> AdapterVersion:
        try:
            return self._publish_locked(name, adapter)
        finally:
            self._notify_dropped()

    def _publish_locked(self, name: str, adapter: LoadedAdapter) -> AdapterVersion:
        with self._lock:
            old = self._entries.get(name)
            self._make_room(adapter.nbytes, name)
            version = AdapterVersion(name, next(self._versions), adapter)
            self._held[(name, version.version)] = _Held(version)
            if old is None:
                self._entries[name] = _Entry(version, last_used=next(self._clock))
                kind = "load"
            else:
                self._retire(old.current)
                old.current = version
                old.last_used = next(self._clock)
                kind = "replace"
            event = AdapterEvent(kind, name, version.version, adapter.digest, "", adapter.source)
            self._emit(event)
            return version

    def check_room(self, name: str, need: int) -> None:
        """Refuse now, before anything is read, a load of ``need`` bytes that could not fit.

        The same arithmetic as publishing, without evicting: what is evictable now may
        be held by then, so publishing checks again.
        """
        if self.budget_bytes is None:
            return
        with self._lock:
            self._victims(need, name)

    def _make_room(self, need: int, replacing: str) -> None:
        if self.budget_bytes is None:
            return
        for e in self._victims(need, replacing):
            self._drop(e.current.name, "evicted")

    def _victims(self, need: int, replacing: str) -> list[_Entry]:
        """The adapters to evict (least recently used first) so ``need`` bytes fit; or raise."""
        assert self.budget_bytes is not None
        held = sum(h.version.adapter.nbytes for h in self._held.values())
        victims = sorted(
            (
                e
                for n, e in self._entries.items()
                if n != replacing and not e.pinned and self._held[(n, e.current.version)].holds == 0
            ),
            key=lambda e: e.last_used,
        )
        free = self.budget_bytes - held
        chosen: list[_Entry] = []
        for e in victims:
            if free >= need:
                break
            chosen.append(e)
            free += e.current.adapter.nbytes
        if free < need:
            raise AdapterBudgetExhausted(
                f"adapter {replacing!r} needs {need} bytes; the adapter budget of "
                f"{self.budget_bytes} bytes holds {held}, and held or pinned adapters "
                "cannot be evicted"
            )
        return chosen

    # --- unloading, pinning ---------------------------------------------------------

    def unload(self, name: str) -> AdapterVersion:
        try:
            with self._lock:
                return self._drop(name, "unloaded")
        finally:
            self._notify_dropped()

    def _drop(self, name: str, reason: str) -> AdapterVersion:
        entry = self._entries.pop(name, None)
        if entry is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded", adapter=name)
        self._retire(entry.current)
        v = entry.current
        self._emit(
            AdapterEvent("unload", name, v.version, v.adapter.digest, reason, v.adapter.source)
        )
        return v

    def _retire(self, version: AdapterVersion) -> None:
        key = (version.name, version.version)
        held = self._held[key]
        held.retired = True
        if held.holds == 0:
            del self._held[key]
            self._dropped.append(key)

    def set_pinned(self, name: str, pinned: bool) -> None:
        with self._lock:
            self._entry(name).pinned = pinned

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded", adapter=name)
        return entry

    # --- holds -----------------------------------------------------------------------

    def hold(self, name: str) -> AdapterHold:
        """Hold the current version of ``name`` until the hold is released."""
        with self._lock:
            entry = self._entry(name)
            entry.last_used = next(self._clock)
            self._held[(name, entry.current.version)].holds += 1
            return AdapterHold(self, entry.current)

    def hold_version(self, name: str, version: int) -> AdapterHold:
        """Hold ``version`` of ``name`` (current or retired) while it still exists.

        For a second process attaching to an adapter pack another one fetched: the
        version it maps must stay held, but it may no longer be the current one.
        """
        with self._lock:
            held = self._held.get((name, version))
            if held is None:
                raise AdapterNotFound(
                    f"version {version} of adapter {name!r} is no longer held",
                    adapter=name,
                    version=version,
                )
            held.holds += 1
            return AdapterHold(self, held.version)

    def _release(self, version: AdapterVersion) -> None:
        with self._lock:
            key = (version.name, version.version)
            held = self._held[key]
            held.holds -= 1
            if held.holds == 0 and held.retired:
                del self._held[key]
                self._dropped.append(key)
        self._notify_dropped()

    # --- observers -------------------------------------------------------------------

    def on_drop(self, callback: Callable[[str, int], None]) -> None:
        """Call ``callback(name, version)`` whenever a version is let go (see ``_on_drop``)."""
        with self._lock:
            self._on_drop.append(callback)

    def on_event(self, callback: Callable[[AdapterEvent], None]) -> None:
        """Call ``callback(event)`` for every event, under the registry lock: keep it cheap."""
        with self._lock:
            self._on_event.append(callback)

    def _notify_dropped(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
            callbacks = list(self._on_drop)
        for name, version in dropped:
            for callback in callbacks:
                callback(name, version)

    # --- watching and reading --------------------------------------------------------

    def watch(self) -> Watch:
        """A watcher, first told of every current adapter as a load, then of each change."""
        w = Watch(self)
        with self._lock:
            for entry in self._entries.values():
                v = entry.current
                w.put(AdapterEvent("load", v.name, v.version, v.adapter.digest))
            self._watches.append(w)
        return w

    def _unwatch(self, w: Watch) -> None:
        if w in self._watches:
            self._watches.remove(w)

    def _emit(self, event: AdapterEvent) -> None:
        for callback in self._on_event:
            callback(event)
        for w in list(self._watches):
            w.put(event)

    def current(self) -> list[tuple[AdapterVersion, bool, int]]:
        """(version, pinned, holds) of each loaded adapter, by name."""
        with self._lock:
            return [
                (e.current, e.pinned, self._held[(n, e.current.version)].holds)
                for n, e in sorted(self._entries.items())
            ]

    def stats(self) -> tuple[int, int, int]:
        """(versions held, holds outstanding, bytes held), retired versions included."""
        with self._lock:
            return (
                len(self._held),
                sum(h.holds for h in self._held.values()),
                sum(h.version.adapter.nbytes for h in self._held.values()),
            )
