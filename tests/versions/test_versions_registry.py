"""ModelVersions in process, over real loaded models and a registry, with a fake clock."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models import VERSIONED_LLAMA, build_model
from weightd.client.base.errors import DataLossError, FailedPreconditionError
from weightd.client.receive.stream import check_version
from weightd.server.base.errors import (
    DataIntegrityError,
    InvalidRequest,
    ModelNotFound,
    VersionNotHeld,
)
from weightd.server.registry.holdbounds import HoldBounds
from weightd.server.registry.models import LoadedModel, ModelRegistry, load_model
from weightd.server.registry.versions import ModelVersions, VersionWatch

CONFIG = VERSIONED_LLAMA


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions-registry")
    out = {}
    for seed in (1, 2, 3):
        build_model("llama", CONFIG, seed=seed).save_pretrained(root / f"v{seed}")
        out[f"v{seed}"] = root / f"v{seed}"
    shutil.copytree(root / "v2", root / "v2-again")  # same content, another directory
    out["v2-again"] = root / "v2-again"
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Setup = tuple[ModelRegistry, ModelVersions, Clock]


@pytest.fixture
def setup() -> Iterator[Setup]:
    clock = Clock()
    registry = ModelRegistry()
    versions = ModelVersions(clock)
    versions.attach(registry)
    yield registry, versions, clock
    registry.close()


def publish(registry: ModelRegistry, directory: Path) -> LoadedModel:
    model = load_model(str(directory), "m")
    registry.publish(model)
    return model


def drain(watch: VersionWatch) -> list[tuple[str, int]]:
    out = []
    while (e := watch.next(timeout=0)) is not None:
        out.append((e.kind, e.info.version))
    return out


def test_numbers_follow_content_not_publishes(setup: Setup, dirs: dict[str, Path]) -> None:
    registry, versions, _ = setup
    watch = versions.watch("m")
    a = publish(registry, dirs["v1"])
    b = publish(registry, dirs["v2"])
    c = publish(registry, dirs["v2-again"])  # same fingerprint: same number, no event
    assert (a.version, b.version, c.version) == (1, 2, 2)
    assert versions.resolve("m", 2) is c  # the fresh object serves the number
    assert drain(watch) == [("ready", 1), ("ready", 2), ("dropped", 1)]
    d = publish(registry, dirs["v1"])  # old content again: a new number
    assert d.version == 3
    assert versions.resolve("m", 0) is d
    other = versions.watch("")  # a late watcher first hears the current version
    assert drain(other) == [("ready", 3)]


def test_holds_keep_versions_and_the_last_release_drops(
    setup: Setup, dirs: dict[str, Path]
) -> None:
    registry, versions, clock = setup
    publish(registry, dirs["v1"])
    h1, info = versions.hold("m", 1, "engine-a", 60)
    h2, _ = versions.hold("m", 0, "engine-b", 60)  # 0: the current one, i.e. 1
    versions.hold("m", 1, "engine-a", 60)  # a second rank of engine a: h3, expires
    assert info.version == 1 and h2.version == 1
    dropped: list[int] = []
    versions.on_drop(lambda i: dropped.append(i.version))
    publish(registry, dirs["v2"])
    held = {(v.version, v.current): (v.holds, v.engines) for v in versions.held()}
    assert held == {(1, False): (3, 2), (2, True): (0, 0)}
    assert versions.resolve("m", 1).version == 1
    assert versions.release(h1.hold_id) and not versions.release(h1.hold_id)
    assert versions.release(h2.hold_id)
    assert dropped == []
    clock.now += 61  # h3 expires
    with pytest.raises(VersionNotHeld, match=r"version 1 is not held .*held: 2; current: 2"):
        versions.resolve("m", 1)
    assert dropped == [1]
    with pytest.raises(VersionNotHeld):
        versions.hold("m", 1, "late", 60)
    with pytest.raises(InvalidRequest):
        versions.release("")


def test_ttls_are_bounded(setup: Setup, dirs: dict[str, Path]) -> None:
    registry, versions, _ = setup
    publish(registry, dirs["v1"])
    default, _ = versions.hold("m", 1, "", 0)
    capped, _ = versions.hold("m", 1, "", 10**9)
    assert (default.ttl, capped.ttl) == (600.0, 3600.0)


def test_a_hoarding_client_never_stops_another_client_holding(dirs: dict[str, Path]) -> None:
    """Holds past a bound end the hoarder's oldest, never refuse: the engine (another
    client) always gets its hold and keeps it, and the hoarder's count stays bounded."""
    registry = ModelRegistry()
    versions = ModelVersions(Clock(), HoldBounds(max_holds=6, max_holds_per_client=4))
    versions.attach(registry)
    try:
        publish(registry, dirs["v1"])
        engine, _ = versions.hold("m", 1, "vllm", 60, client="ipv4:10.0.0.2")
        hoarded = [versions.hold("m", 1, "x", 60, client="ipv4:10.0.0.9")[0] for _ in range(50)]
        assert versions.release(engine.hold_id)  # never ended by the hoarder
        assert [versions.release(h.hold_id) for h in hoarded[-4:]] == [True] * 4
        assert not any(versions.release(h.hold_id) for h in hoarded[:-4])
        assert versions.evictions()[0] == 46
        # in all: the client holding the most loses its oldest, not the newcomer
        for client in ("a", "b"):
            versions.hold("m", 1, "", 60, client=client)
        big = [versions.hold("m", 1, "", 60, client="c")[0] for _ in range(4)]
        versions.hold("m", 1, "", 60, client="d")
        assert not versions.release(big[0].hold_id)
        assert sum(v.holds for v in versions.held()) == 6
    finally:
        registry.close()


def test_old_versions_kept_are_bounded(dirs: dict[str, Path]) -> None:
    """A client that holds every version keeps at most ``max_old`` besides the current."""
    registry = ModelRegistry()
    versions = ModelVersions(Clock(), HoldBounds(max_old=1))
    versions.attach(registry)
    dropped: list[int] = []
    versions.on_drop(lambda i: dropped.append(i.version))
    try:
        for name in ("v1", "v2", "v3", "v1"):
            publish(registry, dirs[name])
            versions.hold("m", 0, "hoarder", 600)
        held = {v.version: v.current for v in versions.held()}
        assert held == {3: False, 4: True}
        assert dropped == [1, 2]
        assert versions.evictions()[1] == 2
        with pytest.raises(VersionNotHeld):
            versions.resolve("m", 2)
    finally:
        registry.close()


def test_unknown_and_broken_versions(setup: Setup, dirs: dict[str, Path]) -> None:
    registry, versions, _ = setup
    old = publish(registry, dirs["v1"])
    versions.hold("m", 1, "x", 60)
    publish(registry, dirs["v3"])
    with pytest.raises(ModelNotFound):
        versions.resolve("other", 1)
    with pytest.raises(VersionNotHeld):
        versions.resolve("m", 7)
    registry.mark_broken(old, "shard changed")
    with pytest.raises(DataIntegrityError, match="version 1 is not served: shard changed"):
        versions.resolve("m", 1)
    current = versions.resolve("m", 2)
    assert current.version == 2  # the current one is unaffected
    # ... and a broken current one leaves an older held version served
    versions.hold("m", 2, "x", 60)
    newest = publish(registry, dirs["v2"])
    registry.mark_broken(newest, "truncated")
    with pytest.raises(DataIntegrityError):
        versions.resolve("m", 0)
    assert versions.resolve("m", 2) is current
    assert versions.resolve("", 2) is current


@pytest.mark.parametrize(
    ("asked", "named", "error"),
    [
        (0, 0, None),  # the current version, from any daemon
        (0, 5, None),
        (5, 5, None),
        (5, 0, FailedPreconditionError),  # a daemon that predates versions
        (5, 6, DataLossError),  # another version than asked for
    ],
)
def test_a_client_refuses_a_stream_of_another_version(
    asked: int, named: int, error: type[Exception] | None
) -> None:
    if error is None:
        check_version(asked, named)
    else:
        with pytest.raises(error):
            check_version(asked, named)
