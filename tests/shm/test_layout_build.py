"""A layout's packs built in one pass, in process: exactly each rank's verified slices.

Every kind of cut the planner makes goes through the builder here: whole tensors,
blocks of dim 0 read straight into the packs, row-parallel (strided) cuts through
scratch, kv heads replicated across ranks (llama-gqa at TP=4: copies checked against
the slice they were copied from), a padded vocabulary, pipeline stages that hold only
some tensors. And the two ways a build must fail: a shard changed under it (DATA_LOSS,
the model then serves nothing) and a pack that does not fit the budget.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import blake3
import pytest

from weightd.server.base.errors import DataIntegrityError, PackPending
from weightd.server.packs.layoutbuild import build_layout_packs
from weightd.server.plan.declared import DeclaredLayout, LayoutGroup
from weightd.server.registry.models import ModelRegistry, load_model
from weightd.server.transports.local_service import PackService, key_of
from weightd.server.transports.options import LocalConfig, PrebuildOptions
from weightd.server.transports.prebuild import LayoutPrebuilder
from weightd.server.weights.service import WeightService
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

CASES = [
    ("llama", LayoutGroup(1)),
    ("llama", LayoutGroup(2)),
    ("llama", LayoutGroup(2, vocab_pad=64)),
    ("llama-gqa", LayoutGroup(4)),  # 2 kv heads over 4 ranks: replicated
    ("qwen2", LayoutGroup(2, pp_size=2)),  # q/k/v biases; stages hold some tensors
    ("qwen3", LayoutGroup(2, vocab_pad=64)),
]


@pytest.mark.parametrize(("name", "group"), CASES, ids=str)
def test_every_rank_holds_exactly_its_verified_slices(
    transformers_models: dict[str, Path], name: str, group: LayoutGroup
) -> None:
    model = load_model(str(transformers_models[name]))
    try:
        plans = [model.plan_layout(layout) for layout in group.ranks()]
        packs = build_layout_packs(model, plans, [f"t:{i}" for i in range(len(plans))], threads=3)
        try:
            for plan, pack in zip(plans, packs, strict=True):
                assert [e.name for e in pack.entries] == [s.name for s in plan.slices]
                for e, s in zip(pack.entries, plan.slices, strict=True):
                    want = b"".join(model.store.iter_pattern(s.shard, s.pattern, 1 << 20))
                    got = pack.mapping[e.offset : e.offset + e.nbytes]
                    assert got == want, (e.name, plan.layout)
                    assert e.digest == "blake3:" + blake3.blake3(want).hexdigest()
                    # The same value the gRPC stream anchors from its own read of the file.
                    assert e.digest == model.slice_anchor(s, plan.layout, "blake3")
        finally:
            for p in packs:
                p.close()
    finally:
        model.store.close()


def _changed_under_us(src: Path, tmp: Path) -> tuple[Path, str]:
    """A copy of ``src`` and the shard to rewrite in place after it is verified."""
    copy = tmp / "model"
    shutil.copytree(src, copy)
    shard = sorted(p.name for p in copy.glob("*.safetensors"))[0]
    return copy, shard


def _rewrite(path: Path) -> None:
    """Flip the last kilobyte of tensor bytes; size and mtime as they were (only the
    bytes tell: what the build's own hash must catch)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 1024)
        data = f.read(1024)
        f.seek(st.st_size - 1024)
        f.write(bytes(b ^ 0x5A for b in data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_declared_build_that_reads_changed_bytes_fails_the_model_with_data_loss(
    transformers_models: dict[str, Path], tmp_path: Path
) -> None:
    directory, shard = _changed_under_us(transformers_models["llama"], tmp_path)
    registry = ModelRegistry()
    packs = PackService(WeightService(registry), LocalConfig())
    declared = (DeclaredLayout(None, LayoutGroup(2)),)
    prebuilder = LayoutPrebuilder(packs, PrebuildOptions(declared=declared), None)
    model = load_model(str(directory), "m")
    try:
        _rewrite(directory / shard)
        with pytest.raises(DataIntegrityError, match="bytes read into the packs hash to"):
            prebuilder.prepare(model)
        assert model.broken is not None and "hash to" in model.broken
        registry.publish(model)  # as start-up does: published broken, serving nothing
        assert registry.state("m")[0] == "broken"
        assert packs.host.states() == []  # no pack of it exists, half-built or whole
        answer = packs.handle(
            lpb.LocalRequest(acquire=lpb.AcquirePack(model="m", layout=pb.Layout(tp_size=1)))
        ).response
        assert answer.WhichOneof("response") == "error"
        assert answer.error.code == 15  # DATA_LOSS
        assert "not served until reloaded" in answer.error.detail
    finally:
        prebuilder.close()
        packs.close()
        registry.close()


def test_a_worker_that_does_not_wait_gets_pending_before_the_build_says_built(
    transformers_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The order is the daemon's own: ``pack_pending`` is logged before the build it
    starts can log ``pack_built``; the asker holds no lease meanwhile, the next one
    (after the build) gets the pack."""
    registry = ModelRegistry()
    packs = PackService(WeightService(registry), LocalConfig())
    model = load_model(str(transformers_models["llama"]), "m")
    registry.publish(model)
    request = lpb.LocalRequest(
        acquire=lpb.AcquirePack(model="m", layout=pb.Layout(tp_size=2, tp_rank=1), no_wait=True)
    )
    try:
        with caplog.at_level("INFO", logger="weightd"):
            first = packs.handle(request).response
            assert first.WhichOneof("response") == "error"
            assert first.error.pending and first.error.transport and first.error.code == 14
            layout = model.plan(2, 1).layout
            states = {s.info.layout: s for s in packs.host.states()}  # type: ignore[attr-defined]
            assert layout in states and states[layout].leases == 0
            # Wait for the build by the cache's own future, not by a clock.
            slot = packs.host._slots[key_of(model, layout)]
            slot.future.result(timeout=60)
            second = packs.handle(request)
            assert second.response.WhichOneof("response") == "grant"
            assert not second.response.grant.built  # the background build made it
            assert second.lease is not None
            second.lease.release()  # (its descriptor is the pack's own, sent as is)
        events = [r.getMessage().split()[0] for r in caplog.records if r.name == "weightd"]
        assert events.index("pack_pending") < events.index("pack_built")
        pending = next(r.getMessage() for r in caplog.records if "pack_pending" in r.getMessage())
        assert "layout=tp2:r1" in pending and "build=started" in pending
    finally:
        packs.close()
        registry.close()


def test_a_pack_being_built_is_pending_for_a_no_wait_asker_and_shared_with_a_waiter() -> None:
    """The cache alone: a no-wait asker of a building pack is told so at once."""
    import threading
    from itertools import count

    from weightd.server.packs.cache import PackCache

    class P:
        size = 1

        def close(self) -> None:
            pass

    release = threading.Event()
    ids = count(1)
    cache: PackCache[P] = PackCache("test pack", 10, 60.0, lambda: next(ids))

    def slow() -> P:
        release.wait(60)
        return P()

    waiter = threading.Thread(target=lambda: cache.acquire("k", 1, None, slow).release())
    waiter.start()
    while not cache.has("k"):
        threading.Event().wait(0.001)
    told: list[bool] = []
    with pytest.raises(PackPending, match="is being built"):
        cache.acquire("k", 1, None, slow, wait=False, on_pending=told.append)
    assert told == [False]
    release.set()
    waiter.join(60)
    lease = cache.acquire("k", 1, None, slow, wait=False)
    assert lease.pack is not None and not lease.built
    lease.release()
    cache.close()
