"""Leases, TTL and budget of the pack cache: the pure policy as tables, then the cache."""

from __future__ import annotations

import threading
from collections.abc import Hashable

import pytest

from weightd.server.base.errors import PackMemoryExhausted, StaleGrant
from weightd.server.packs.cache import PackCache, SlotState, evictions_for, expired


def S(key: str, size: int, leases: int = 0, idle: float | None = None) -> SlotState:
    return SlotState(key, size, leases, idle)


@pytest.mark.parametrize(
    ("slots", "budget", "incoming", "evict"),
    [
        ([], 100, 100, []),
        ([S("a", 50, idle=1.0)], 100, 50, []),  # fits without evicting
        ([S("a", 50, idle=1.0)], 100, 60, ["a"]),
        ([S("a", 30, idle=2.0), S("b", 30, idle=1.0)], 100, 60, ["b"]),  # least recent first
        ([S("a", 30, idle=2.0), S("b", 30, idle=1.0)], 100, 100, ["b", "a"]),
        ([S("a", 50, leases=1), S("b", 30, idle=5.0)], 100, 50, ["b"]),  # never the leased
        ([S("a", 50, leases=2), S("b", 40, idle=0.0)], 100, 50, ["b"]),
    ],
)
def test_evictions(slots: list[SlotState], budget: int, incoming: int, evict: list[str]) -> None:
    assert evictions_for(slots, budget, incoming, "test") == evict


@pytest.mark.parametrize(
    ("slots", "budget", "incoming"),
    [
        ([S("a", 60, leases=1)], 100, 50),  # everything leased
        ([S("a", 60, leases=1), S("b", 30, idle=1.0)], 100, 50),  # not even with b gone
        ([S("a", 10)], 100, 101),  # bigger than the whole budget
        ([S("build", 80, idle=None)], 100, 30),  # a pack being built counts as held
    ],
)
def test_budget_exhausted(slots: list[SlotState], budget: int, incoming: int) -> None:
    with pytest.raises(PackMemoryExhausted) as err:
        evictions_for(slots, budget, incoming, "shared-memory pack")
    msg = str(err.value)
    assert "shared-memory pack budget exhausted" in msg
    assert f"{incoming} bytes" in msg and f"{budget} bytes" in msg
    assert "never freed" in msg


@pytest.mark.parametrize(
    ("slots", "now", "ttl", "gone"),
    [
        ([S("a", 1, idle=0.0)], 5.0, 10.0, []),
        ([S("a", 1, idle=0.0)], 10.0, 10.0, ["a"]),
        ([S("a", 1, leases=1), S("b", 1, idle=0.0)], 100.0, 1.0, ["b"]),  # leased: never
        ([S("a", 1, idle=3.0), S("b", 1, idle=9.0)], 10.0, 5.0, ["a"]),
        ([S("a", 1, idle=3.0)], 3.0, 0.0, ["a"]),  # ttl 0: as soon as the last lease ends
    ],
)
def test_expired(slots: list[SlotState], now: float, ttl: float, gone: list[str]) -> None:
    assert expired(slots, now, ttl) == gone


# --- the cache itself, with fake packs and a fake clock -----------------------------------


class FakePack:
    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.closed = False

    def close(self) -> None:
        assert not self.closed, "closed twice"
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_cache(budget: int = 100, ttl: float = 10.0) -> tuple[PackCache[FakePack], Clock]:
    clock = Clock()
    counter = iter(range(1, 1000))
    return PackCache[FakePack]("test", budget, ttl, lambda: next(counter), clock), clock


def keys(cache: PackCache[FakePack]) -> dict[Hashable, int]:
    return {s.info: s.leases for s in cache.states()}


def test_shared_pack_lease_ttl_cycle() -> None:
    cache, clock = make_cache()
    built: list[FakePack] = []

    def build() -> FakePack:
        built.append(FakePack("a", 40))
        return built[-1]

    one = cache.acquire("a", 40, "a", build)
    two = cache.acquire("a", 40, "a", build)
    assert one.pack is two.pack and len(built) == 1
    assert one.built and not two.built and one.pack_id == two.pack_id
    assert keys(cache) == {"a": 2}
    one.release()
    one.release()  # idempotent
    clock.now = 100.0
    assert cache.reap() == 0  # still leased by two
    two.release()
    clock.now = 105.0
    assert cache.reap() == 0 and keys(cache) == {"a": 0}
    clock.now = 110.0
    assert cache.reap() == 1 and keys(cache) == {}
    assert built[0].closed
    assert cache.builds_total == 1 and cache.evictions_total == 1


def test_budget_evicts_idle_lru_and_refuses_when_all_leased() -> None:
    cache, clock = make_cache(budget=100)
    a = cache.acquire("a", 50, "a", lambda: FakePack("a", 50))
    b = cache.acquire("b", 50, "b", lambda: FakePack("b", 50))
    with pytest.raises(PackMemoryExhausted, match="100 bytes are held"):
        cache.acquire("c", 50, "c", lambda: FakePack("c", 50))
    assert keys(cache) == {"a": 1, "b": 1}  # nothing leased was touched
    pa, pb = a.pack, b.pack
    clock.now = 1.0
    b.release()
    clock.now = 2.0
    a.release()  # a is now the most recently used
    c = cache.acquire("c", 50, "c", lambda: FakePack("c", 50))
    assert keys(cache) == {"a": 0, "c": 1}
    assert pb.closed and not pa.closed
    c.release()


def test_concurrent_first_requests_build_once() -> None:
    cache, _ = make_cache()
    release = threading.Event()
    builds: list[int] = []

    def slow_build() -> FakePack:
        builds.append(1)
        assert release.wait(10)
        return FakePack("a", 10)

    leases = []
    threads = [
        threading.Thread(target=lambda: leases.append(cache.acquire("a", 10, "a", slow_build)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(10)
    assert len(builds) == 1 and len(leases) == 8
    assert len({id(lease.pack) for lease in leases}) == 1
    assert sum(lease.built for lease in leases) == 1
    assert keys(cache) == {"a": 8}


def test_a_failed_build_leaves_nothing_behind() -> None:
    cache, _ = make_cache()

    def broken() -> FakePack:
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        cache.acquire("a", 10, "a", broken)
    assert keys(cache) == {} and cache.used_bytes == 0
    ok = cache.acquire("a", 10, "a", lambda: FakePack("a", 10))  # a retry builds afresh
    assert ok.built


def test_attach_by_id_and_stale_ids() -> None:
    cache, clock = make_cache(ttl=1.0)
    first = cache.acquire("a", 10, "a", lambda: FakePack("a", 10))
    second = cache.attach(first.pack_id)
    assert second.pack is first.pack and not second.built
    assert keys(cache) == {"a": 2}
    first.release()
    second.release()
    clock.now = 5.0
    cache.reap()
    with pytest.raises(StaleGrant, match="does not exist"):
        cache.attach(first.pack_id)


def test_close_frees_everything_even_leased() -> None:
    cache, _ = make_cache()
    lease = cache.acquire("a", 10, "a", lambda: FakePack("a", 10))
    cache.close()
    assert lease.pack.closed
    lease.release()  # harmless after close
