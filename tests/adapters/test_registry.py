"""The registry: watch order, holds across replace/unload, LRU budget, coalesced loads."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import blake3
import pytest

from tests.adapters.conftest import Fixture
from weightd.common.digests import format_digest
from weightd.server.adapters.config import parse_adapter_config
from weightd.server.adapters.load import LoadedAdapter, load_adapter
from weightd.server.adapters.plan import plan_adapter
from weightd.server.adapters.registry import AdapterRegistry
from weightd.server.base.errors import AdapterBudgetExhausted, AdapterNotFound, AdapterShapeError
from weightd.server.checkpoint.description import Checkpoint
from weightd.server.checkpoint.scan import load_checkpoint
from weightd.server.plan.builtin_rules import rules_for

CONFIG = parse_adapter_config("c.json", b'{"r": 1, "lora_alpha": 1, "target_modules": ["q"]}')


def fake(n: int, tag: str = "") -> LoadedAdapter:
    return LoadedAdapter(f"/a/{tag}", CONFIG, (), b"\0" * n, {}, f"sha256:{tag}")


@pytest.fixture(scope="module")
def base(lora: Fixture) -> Iterator[Checkpoint]:
    ckpt, store = load_checkpoint(str(lora.base_dir), "tiny-llama")
    store.close()
    yield ckpt


def test_watch_sees_load_replace_unload_in_order(lora: Fixture, base: Checkpoint) -> None:
    reg = AdapterRegistry()
    roots = [str(lora.root)]
    first, second = str(lora.adapter_dir), str(lora.second_dir)
    reg.load("pre", first, None, lambda: load_adapter(first, roots, base))
    w = reg.watch()
    v1 = reg.load("x", first, None, lambda: load_adapter(first, roots, base))
    v2 = reg.load("x", second, None, lambda: load_adapter(second, roots, base))
    reg.unload("x")
    w.close()
    events = list(w)
    assert [(e.kind, e.name) for e in events] == [
        ("load", "pre"),  # the state at subscribe time
        ("load", "x"),
        ("replace", "x"),
        ("unload", "x"),
    ]
    assert [e.version for e in events[1:]] == [v1.version, v2.version, v2.version]
    assert events[1].digest == v1.adapter.digest != events[2].digest == v2.adapter.digest
    assert v1.version < v2.version
    assert reg.stats() == (1, 0, reg.current()[0][0].adapter.nbytes)


def fetch_and_check(reg: AdapterRegistry, base: Checkpoint, name: str) -> int:
    """One worker fetch (TP=1): lease, cut every slice, check each against load digests."""
    with reg.hold(name) as version:
        adapter = version.adapter
        plan = plan_adapter(adapter.modules, base, rules_for(base.config), 1, 0)
        assert len(plan.slices) == 2 * len(adapter.modules)
        halves = [x for m in adapter.modules for x in (m.a, m.b)]
        for s, t in zip(plan.slices, halves, strict=True):
            got = format_digest("blake3", blake3.blake3(adapter.read(s.pattern)).hexdigest())
            assert got == adapter.tensor_digests[t.name]
        return version.version


def test_fetches_race_replace_and_unload(lora: Fixture, base: Checkpoint) -> None:
    reg = AdapterRegistry()
    roots = [str(lora.root)]
    sources = [str(lora.adapter_dir), str(lora.second_dir)]
    loaded = {s: load_adapter(s, roots, base) for s in sources}
    reg.load("hot", sources[0], None, lambda: loaded[sources[0]])
    done = threading.Event()
    fetched: list[int] = []
    missing = [0]
    failures: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        while not done.is_set():
            try:
                v = fetch_and_check(reg, base, "hot")
            except AdapterNotFound:
                with lock:
                    missing[0] += 1
                continue
            except BaseException as exc:
                failures.append(exc)
                return
            with lock:
                fetched.append(v)

    def churn() -> None:
        try:
            churn_loop()
        except BaseException as exc:
            failures.append(exc)

    def churn_loop() -> None:
        i = 0
        while not done.is_set():
            i += 1
            src = sources[i % 2]
            reg.load("hot", src, None, lambda src=src: loaded[src])
            if i % 3 == 0:
                reg.unload("hot")
                reg.load("hot", src, None, lambda src=src: loaded[src])

    threads = [threading.Thread(target=worker) for _ in range(6)] + [threading.Thread(target=churn)]
    for t in threads:
        t.start()
    # Until enough fetches completed, over enough versions (misses while unloaded are cheap
    # and many; they are allowed: NOT_FOUND is what a worker sees between unload and load).
    while (len(fetched) < 150 or len(set(fetched)) < 5) and not failures and threads[-1].is_alive():
        threading.Event().wait(0.01)
    done.set()
    for t in threads:
        t.join()
    assert not failures, failures[0]
    assert len(fetched) >= 150
    assert len(set(fetched)) >= 5  # fetches really spanned several versions
    held, holds, nbytes = reg.stats()
    assert (held, holds) == (1, 0)  # every retired version freed once its holds ended
    assert nbytes == reg.current()[0][0].adapter.nbytes


def test_hold_outlives_unload_and_replace() -> None:
    reg = AdapterRegistry()
    reg.load("a", "s1", None, lambda: fake(10, "1"))
    lease = reg.hold("a")
    reg.load("a", "s2", None, lambda: fake(20, "2"))
    assert reg.stats() == (2, 1, 30)
    reg.unload("a")
    assert reg.stats() == (1, 1, 10)
    assert lease.version.adapter.digest == "sha256:1"
    lease.release()
    lease.release()  # once only
    assert reg.stats() == (0, 0, 0)
    with pytest.raises(AdapterNotFound, match="no adapter named 'a' is loaded"):
        reg.hold("a")


def test_budget_evicts_lru_unleased_unpinned_only() -> None:
    reg = AdapterRegistry(budget_bytes=100)
    w = reg.watch()
    for name in ("a", "b", "c"):
        reg.load(name, name, None, lambda: fake(30))
    reg.hold("a").release()  # a is now more recent than b
    reg.set_pinned("c", True)
    reg.load("d", "d", None, lambda: fake(30))  # needs 20 more: evicts b (LRU, unpinned)
    assert [v.name for v, _, _ in reg.current()] == ["a", "c", "d"]
    held = reg.hold("a")
    with pytest.raises(AdapterBudgetExhausted, match="adapter 'e' needs 60 bytes"):
        reg.load("e", "e", None, lambda: fake(60))  # a leased, c pinned: only d could go
    assert [v.name for v, _, _ in reg.current()] == ["a", "c", "d"]  # nothing evicted
    held.release()
    reg.load("e", "e", None, lambda: fake(60))  # evicts d then a
    assert [v.name for v, _, _ in reg.current()] == ["c", "e"]
    w.close()
    unloads = [(e.name, e.reason) for e in w if e.kind == "unload"]
    assert unloads == [("b", "evicted"), ("d", "evicted"), ("a", "evicted")]


def test_concurrent_loads_coalesce() -> None:
    reg = AdapterRegistry()
    gate = threading.Event()
    calls = [0]

    def read() -> LoadedAdapter:
        calls[0] += 1
        gate.wait()
        return fake(8)

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(reg.load("a", "s", None, read)))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    while len(reg._loading) == 0:
        threading.Event().wait(0.001)
    threading.Event().wait(0.05)
    gate.set()
    for t in threads:
        t.join()
    assert calls[0] == 1
    assert len({r.version for r in results}) == 1 and len(results) == 8


def test_failed_load_is_shared_and_publishes_nothing() -> None:
    reg = AdapterRegistry()

    def boom() -> LoadedAdapter:
        raise AdapterNotFound("nope")

    with pytest.raises(AdapterNotFound):
        reg.load("a", "s", None, boom)
    assert reg.current() == [] and reg.stats() == (0, 0, 0) and not reg._loading


def test_versions_are_let_go_once_retired_and_unleased() -> None:
    """The drop callback (adapter packs are freed on it) fires exactly when a version's
    bytes go: at once for an unleased replace/unload, at the last release otherwise."""
    reg = AdapterRegistry()
    dropped: list[tuple[str, int]] = []
    reg.on_drop(lambda name, version: dropped.append((name, version)))
    v1 = reg.load("x", "1", None, lambda: fake(10, "1"))
    v2 = reg.load("x", "2", None, lambda: fake(10, "2"))
    assert dropped == [("x", v1.version)]  # replaced, never leased
    lease = reg.hold("x")
    again = reg.hold_version("x", v2.version)  # an attach to v2's pack
    v3 = reg.load("x", "3", None, lambda: fake(10, "3"))
    assert dropped == [("x", v1.version)]  # v2 retired but leased twice
    lease.release()
    assert dropped == [("x", v1.version)]
    again.release()
    assert dropped == [("x", v1.version), ("x", v2.version)]
    with pytest.raises(AdapterNotFound, match=f"version {v2.version} of adapter 'x'"):
        reg.hold_version("x", v2.version)
    reg.unload("x")
    assert dropped[-1] == ("x", v3.version) and reg.stats() == (0, 0, 0)


def test_rejection_reasons_are_a_fixed_table() -> None:
    from weightd.server.adapters.collector import REJECTION_REASONS, rejection_reason
    from weightd.server.base import errors

    cases = {
        errors.UnsupportedAdapterFeature("d", "DoRA"): "unsupported_feature",
        errors.AdapterShapeError("f", "shape"): "shape",
        errors.PathEscapeError("d", "outside"): "unsafe_path",
        errors.DigestMismatchError("d", "digest"): "digest_mismatch",
        errors.AdapterBudgetExhausted("full"): "budget",
        errors.InvalidRequest("empty name"): "invalid_request",
        OSError("disk"): "io",
        RuntimeError("bug"): "internal",
    }
    for error, reason in cases.items():
        assert rejection_reason(error) == reason, error
        assert reason in REJECTION_REASONS
    assert len(set(REJECTION_REASONS)) == len(REJECTION_REASONS)


class _Held:
    """Stands for the bytes a read holds (bytes cannot be weakly referenced)."""


def test_a_failed_read_frees_what_it_held_when_the_call_ends() -> None:
    """With the collector off, what a failed read held is gone as soon as ``load`` raises:
    no exception -> traceback -> frame -> future cycle keeps it (#15 item 6). Before, it
    stayed until a garbage collection (1 GiB per failed load of a 1 GiB adapter)."""
    reg = AdapterRegistry(budget_bytes=1 << 20)
    refs: list[weakref.ref[_Held]] = []

    def read() -> LoadedAdapter:
        held = _Held()
        refs.append(weakref.ref(held))
        raise AdapterShapeError("a/adapter_model.safetensors", "bad shape")

    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            with pytest.raises(AdapterShapeError):
                reg.load("a", "/a", None, read)
        assert [r() for r in refs] == [None, None, None]
    finally:
        if enabled:
            gc.enable()


def test_check_room_refuses_before_a_read_and_evicts_nothing() -> None:
    reg = AdapterRegistry(budget_bytes=100)
    reg.load("a", "/a", None, lambda: fake(60, "a"))
    reg.check_room("b", 100)  # fits once "a" (unleased) is evicted: not refused
    lease = reg.hold("a")
    with pytest.raises(AdapterBudgetExhausted, match="adapter 'b' needs 100 bytes"):
        reg.check_room("b", 100)
    lease.release()
    with pytest.raises(AdapterBudgetExhausted):
        reg.check_room("b", 101)  # more than the whole budget
    assert [v.name for v, _, _ in reg.current()] == ["a"]  # nothing was evicted
