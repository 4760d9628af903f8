"""Leases, TTL and a byte budget over built packs; concurrent first requests coalesce.

One pack exists per key (model content, layout, rank, placement). A lease pins its
pack: a leased pack is never freed. When the last lease ends, the pack stays for
``ttl`` seconds for the next process that asks (ranks restart, a second replica
starts), and is freed earlier only when a new pack needs its bytes: least recently
used first. When every byte of the budget is leased, a new pack is refused with
:class:`~weightd.server.base.errors.PackMemoryExhausted` naming the numbers; nothing is
freed under a reader.

The policy (:func:`evictions_for`, :func:`expired`) is pure and table-tested; the
cache applies it under one lock and frees packs outside it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ..base.cleanup import release_frames
from ..base.errors import PackMemoryExhausted, PackPending, StaleGrant, TransportError


class Pack(Protocol):
    size: int

    def close(self) -> None: ...


P = TypeVar("P", bound=Pack)


@dataclass(frozen=True, slots=True)
class SlotState:
    """What the policy sees of one pack."""

    key: Hashable
    size: int
    leases: int
    idle_since: float | None  # None while leased or still being built


def evictions_for(
    slots: Sequence[SlotState], budget: int, incoming: int, what: str
) -> list[Hashable]:
    """The idle packs to free so ``incoming`` more bytes fit in ``budget``, oldest idle first.

    Raises PackMemoryExhausted when freeing every idle pack would still not make room.
    """
    used = sum(s.size for s in slots)
    if used + incoming <= budget:
        return []
    idle = sorted((s for s in slots if s.idle_since is not None), key=lambda s: s.idle_since or 0)
    chosen: list[Hashable] = []
    for s in idle:
        chosen.append(s.key)
        used -= s.size
        if used + incoming <= budget:
            return chosen
    held = sum(s.size for s in slots if s.idle_since is None)
    raise PackMemoryExhausted(
        f"{what} budget exhausted: a pack of {incoming} bytes does not fit in "
        f"{budget} bytes; {held} bytes are held by leased or building packs "
        f"({sum(1 for s in slots if s.idle_since is None)} packs), and a leased pack is never freed"
    )


def expired(slots: Sequence[SlotState], now: float, ttl: float) -> list[Hashable]:
    """Idle packs whose last lease ended at least ``ttl`` seconds ago."""
    return [s.key for s in slots if s.idle_since is not None and now - s.idle_since >= ttl]


@dataclass
class _Slot(Generic[P]):
    key: Hashable
    pack_id: int
    size: int
    future: Future[P]
    info: object
    leases: int = 0
    idle_since: float | None = None

    def state(self) -> SlotState:
        return SlotState(self.key, self.size, self.leases, self.idle_since)


class Lease(Generic[P]):
    """One holder's claim on a pack; :meth:`release` is idempotent."""

    def __init__(self, cache: PackCache[P], slot: _Slot[P], pack: P, built: bool) -> None:
        self._cache = cache
        self._slot = slot
        self.pack = pack
        self.pack_id = slot.pack_id
        self.info = slot.info
        self.built = built
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._cache._release(self._slot)


@dataclass(frozen=True, slots=True)
class PackState:
    pack_id: int
    info: object
    size: int
    leases: int
    idle_seconds: float
    pack: object | None  # None while building

    @property
    def building(self) -> bool:
        return self.pack is None


class PackCache(Generic[P]):
    """Packs of one kind (host memory, or one GPU's memory) under one budget and TTL."""

    def __init__(
        self,
        what: str,
        budget_bytes: int,
        ttl_seconds: float,
        next_id: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.budget_bytes = budget_bytes
        self.ttl_seconds = ttl_seconds
        self._next_id = next_id
        self._clock = clock
        self._lock = threading.Lock()
        self._slots: dict[Hashable, _Slot[P]] = {}
        self._closed = False
        self.builds_total = 0
        self.evictions_total = 0

    def acquire(
        self,
        key: Hashable,
        size: int | Callable[[], int],
        info: object,
        build: Callable[[], P],
        *,
        wait: bool = True,
        on_pending: Callable[[bool], None] | None = None,
    ) -> Lease[P]:
        """A lease on the pack for ``key``, building it (once, for all askers) when absent.

        ``size``: the pack's size, or how to compute it (pure), called only when the
        pack must be built: a hit, the common case, skips laying the pack out.

        ``wait=False``: never wait for a build. A pack being built raises
        :class:`PackPending` at once; an absent one starts building on a thread of its
        own and raises PackPending too, so the asker is served another way meanwhile
        (over gRPC, from the verified shards) and the next asker finds the pack.
        ``on_pending(started)`` runs first (before a build it starts), so what it
        records precedes anything that build records.
        """
        victims: list[_Slot[P]] = []
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.what} packs are being freed: the daemon stops")
            slot = self._slots.get(key)
            owner = slot is None
            building = 0
            if slot is None:
                need = size() if callable(size) else size
                for k in evictions_for(
                    [s.state() for s in self._slots.values()], self.budget_bytes, need, self.what
                ):
                    victims.append(self._slots.pop(k))
                slot = _Slot(key, self._next_id(), need, Future(), info)
                self._slots[key] = slot
                self.builds_total += 1
                self.evictions_total += len(victims)
            elif not wait and not slot.future.done():
                building = slot.pack_id
            if not building and (wait or not owner):  # a background build leases nobody
                slot.leases += 1
                slot.idle_since = None
        self._free(victims)
        if building:
            if on_pending is not None:
                on_pending(False)
            raise PackPending(f"{self.what} {building} is being built")
        if owner and not wait:
            if on_pending is not None:
                on_pending(True)
            threading.Thread(
                target=self._build_quietly, args=(slot, build), name="weightd-pack-background"
            ).start()
            raise PackPending(f"{self.what} {slot.pack_id} started building")
        if owner:
            self._build(slot, build)
        return Lease(self, slot, slot.future.result(), owner)

    def _build(self, slot: _Slot[P], build: Callable[[], P]) -> None:
        """Build ``slot``'s pack; waiters get it, or the same error (the slot then goes)."""
        try:
            pack = build()
            if self._is_closed():
                pack.close()
                raise TransportError(f"{self.what} packs are being freed: the daemon stops")
            slot.future.set_result(pack)
        except BaseException as exc:
            # Waiters get the same error; its frames (half-built buffers) go now.
            release_frames(exc)
            with self._lock:
                if self._slots.get(slot.key) is slot:
                    del self._slots[slot.key]
            slot.future.set_exception(exc)
            raise
        with self._lock:
            if slot.leases == 0 and self._slots.get(slot.key) is slot:
                slot.idle_since = self._clock()  # built for nobody yet: its TTL runs

    def _build_quietly(self, slot: _Slot[P], build: Callable[[], P]) -> None:
        """A background build: its failure is the builder's to report (it logs and marks)."""
        try:
            self._build(slot, build)
        except BaseException:
            return

    def has(self, key: Hashable) -> bool:
        """Whether a pack for ``key`` exists or is being built."""
        with self._lock:
            return key in self._slots

    def _is_closed(self) -> bool:
        with self._lock:
            return self._closed

    def attach(self, pack_id: int) -> Lease[P]:
        """A further lease on an existing, built pack, found by id."""
        with self._lock:
            for slot in self._slots.values():
                if slot.pack_id == pack_id and slot.future.done():
                    if slot.future.exception() is not None:
                        break
                    slot.leases += 1
                    slot.idle_since = None
                    return Lease(self, slot, slot.future.result(), False)
        raise StaleGrant(f"pack {pack_id} does not exist (any more) in this daemon")

    def _release(self, slot: _Slot[P]) -> None:
        with self._lock:
            slot.leases -= 1
            if slot.leases == 0 and self._slots.get(slot.key) is slot:
                slot.idle_since = self._clock()
        if self.ttl_seconds <= 0:
            self.reap()

    def reap(self) -> int:
        """Free the idle packs whose TTL has passed; returns how many."""
        with self._lock:
            now = self._clock()
            victims = [
                self._slots.pop(k)
                for k in expired([s.state() for s in self._slots.values()], now, self.ttl_seconds)
            ]
            self.evictions_total += len(victims)
        self._free(victims)
        return len(victims)

    def discard(self, match: Callable[[Hashable], bool]) -> int:
        """Free now the idle packs whose key ``match``es (what they were built from is gone).

        A leased pack is never freed; callers make sure no lease can outlive the source
        (an adapter pack's lease holds its adapter version). Returns how many were freed.
        """
        with self._lock:
            victims = [
                self._slots.pop(k)
                for k, s in list(self._slots.items())
                if s.leases == 0 and s.future.done() and match(k)
            ]
            self.evictions_total += len(victims)
        self._free(victims)
        return len(victims)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._slots.values())

    def states(self) -> list[PackState]:
        with self._lock:
            now = self._clock()
            return [
                PackState(
                    s.pack_id,
                    s.info,
                    s.size,
                    s.leases,
                    0.0 if s.idle_since is None else now - s.idle_since,
                    s.future.result() if s.future.done() and not s.future.exception() else None,
                )
                for s in self._slots.values()
            ]

    def close(self) -> None:
        """Free every built pack, leased or not: the daemon is going away."""
        with self._lock:
            self._closed = True
            victims = list(self._slots.values())
            self._slots.clear()
        self._free(victims)

    @staticmethod
    def _free(victims: list[_Slot[P]]) -> None:
        for slot in victims:
            if slot.future.done() and slot.future.exception() is None:
                slot.future.result().close()
