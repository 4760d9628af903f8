"""Atomic reload, in process: a failed reload leaves the old version serving; a good one
swaps; a replaced version's files close only when its last reader lets go."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from tests.trust import craft
from weightd.server.base.errors import DataSectionError, ModelNotFound
from weightd.server.registry.loading import Reloader
from weightd.server.registry.models import ModelRegistry, load_model
from weightd.server.trust.verify import VerifyOptions

OPTIONS = VerifyOptions(progress=False)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    tmp.replace(path)


def test_reload(tmp_path: Path) -> None:
    d = craft.write_checkpoint(tmp_path / "m")
    registry = ModelRegistry()
    events: list[tuple[str, bool]] = []
    registry.on_change(lambda name, serving: events.append((name, serving)))
    registry.publish(load_model(str(d), "m", options=OPTIONS))
    reloader = Reloader(registry, sources={"m": str(d)}, options=OPTIONS)
    old = registry.get("m")
    old_digests = dict(old.tensor_digests)

    good = (d / craft.SHARD2).read_bytes()
    _replace(d / craft.SHARD2, good[:-4])
    with pytest.raises(DataSectionError):
        reloader.reload("m")
    assert registry.get("m") is old and registry.is_ready("m")
    results = reloader.reload_all()
    assert [r.ok for r in results] == [False] and "truncated" in results[0].detail
    t = old.checkpoint.tensors["model.norm.weight"]
    old.store.check(t.shard)  # renamed over: still the verified inode, still readable
    assert old.store.read_exact(t.shard, t.offset, t.nbytes)

    header, data = craft.entries(craft.shard_tensors(craft.SHARD2))
    _replace(d / craft.SHARD2, craft.encode(header, bytes(b ^ 0xFF for b in data)))
    new = reloader.reload("m").model
    assert registry.get("m") is new and new is not old
    assert new.tensor_digests["model.norm.weight"] != old_digests["model.norm.weight"]
    assert events[-1] == ("m", True)

    # the old version is still open while someone holds it ...
    fd = old.store.shard(t.shard).fd
    os.fstat(fd)
    store = old.store
    del old
    gc.collect()
    # ... and closed once nobody does
    assert store._closed
    with pytest.raises(ModelNotFound):
        reloader.reload("other")
    registry.close()


def test_a_broken_old_version_does_not_mark_its_successor(tmp_path: Path) -> None:
    d = craft.write_checkpoint(tmp_path / "m")
    registry = ModelRegistry()
    registry.publish(load_model(str(d), "m", options=OPTIONS))
    old = registry.get("m")
    Reloader(registry, sources={"m": str(d)}, options=OPTIONS).reload("m")
    registry.mark_broken(old, "late failure of a fetch that started before the swap")
    assert registry.is_ready("m")
    registry.close()
