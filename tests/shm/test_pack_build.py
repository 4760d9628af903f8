"""Building a rank pack in process: sealed, aligned, verified against the anchors."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.smaps import pmd_mapped_bytes
from weightd.server.base.errors import DataIntegrityError
from weightd.server.packs.build import PACK_ALIGN, PACK_SEALS, HostPack
from weightd.server.packs.hugepages import SHMEM_ENABLED, shmem_mode
from weightd.server.packs.layoutbuild import build_host_pack, build_rank_packs
from weightd.server.packs.spare import SparePool
from weightd.server.registry.models import load_model


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


@pytest.mark.parametrize("huge_mode", [None, "advise", "never", "always"])
def test_pack_holds_exactly_the_verified_slices(demo_model: Path, huge_mode: str | None) -> None:
    """Whatever the shmem huge-page mode (this kernel's, or allocation by advice forced)."""
    model = load_model(str(demo_model))
    try:
        plan = model.plan(2, 1)
        pack = build_host_pack(model, plan, "test:tp2:r1", huge_mode=huge_mode)
        try:
            # What grants tell clients (they populate huge packs by default): "always"
            # gives huge pages by itself, "advise" through the advice, which a kernel
            # with THP (it has the sysfs file) accepts whatever the host's mode.
            mode = shmem_mode() if huge_mode is None else huge_mode
            thp = os.path.exists(SHMEM_ENABLED)
            if mode == "never":
                # Collapsed by the daemon after the build, in the background: once that
                # ended, the grant's claim must be what the kernel did, as a client's
                # aligned, populated mapping sees it (smaps).
                assert pack.settled.wait(120)
                assert pack.huge is (2 * pmd_mapped_bytes(pack.fd, pack.size) >= pack.size)
            else:
                want = mode in ("always", "within_size", "force") or (mode == "advise" and thp)
                assert pack.huge is want
            assert fcntl.fcntl(pack.fd, fcntl.F_GET_SEALS) == PACK_SEALS
            assert [e.name for e in pack.entries] == [s.name for s in plan.slices]
            for e, s in zip(pack.entries, plan.slices, strict=True):
                assert e.offset % PACK_ALIGN == 0 and e.nbytes == s.nbytes
                want = b"".join(model.store.iter_pattern(s.shard, s.pattern, 1 << 20))
                assert pack.mapping[e.offset : e.offset + e.nbytes] == want, e.name
                assert e.digest == model.slice_anchor(s, plan.layout, "blake3")
            # Sealed: nobody, the daemon included, can write, shrink or grow it.
            for attempt in (
                lambda: os.pwrite(pack.fd, b"x", 0),
                lambda: os.ftruncate(pack.fd, 0),
                lambda: os.ftruncate(pack.fd, pack.size * 2),
                lambda: fcntl.fcntl(pack.fd, fcntl.F_ADD_SEALS, 0),
            ):
                with pytest.raises(PermissionError) as err:
                    attempt()
                assert err.value.errno == errno.EPERM
        finally:
            pack.close()
    finally:
        model.store.close()


def test_bytes_that_are_not_the_verified_ones_are_never_published(
    demo_model: Path, tmp_path: Path
) -> None:
    """A shard rewritten in place after verification (same size, mtime put back, so
    only the bytes tell): the build's proof fails, and nothing it made stays open."""
    copy = tmp_path / "model"
    shutil.copytree(demo_model, copy)
    model = load_model(str(copy))
    try:
        plan = model.plan(2, 0)
        victim = max(plan.slices, key=lambda s: s.nbytes)
        tensor = model.checkpoint.tensors[victim.name]
        path = copy / tensor.shard
        st = path.stat()
        with open(path, "r+b") as f:
            f.seek(tensor.offset)
            f.write(bytes(b ^ 0xFF for b in f.read(64)))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        before = _open_fds()
        with pytest.raises(DataIntegrityError, match="bytes read into the packs hash to"):
            build_host_pack(model, plan, "test:tp2:r0")
        assert _open_fds() == before  # the memfd and its mappings are gone
    finally:
        model.store.close()


def test_a_pack_freed_during_its_huge_page_upgrade_leaves_nothing_open(demo_model: Path) -> None:
    """The upgrade runs on a duplicate descriptor: freeing the pack (eviction, shutdown)
    right after the build stops it, and once it has settled no descriptor is left."""
    model = load_model(str(demo_model))
    try:
        before = _open_fds()
        pack = build_host_pack(model, model.plan(1, 0), "test:tp1:r0", huge_mode="never")
        pack.close()
        assert pack.settled.wait(120)
        assert _open_fds() == before
    finally:
        model.store.close()


def test_a_build_into_spare_memory_holds_the_same_verified_bytes(demo_model: Path) -> None:
    """The first build prepares spares of its packs' sizes in the background; the next
    build of that layout fills them: the same entries, bytes and digests as a fresh
    build, sealed the same; every spare's descriptor is gone once the pool closes."""
    model = load_model(str(demo_model))
    before = _open_fds()
    pool = SparePool(64 << 20)
    try:
        plans = [model.plan(2, r) for r in range(2)]

        def build() -> list[HostPack]:
            return build_rank_packs(
                model.store,
                model.checkpoint.tensors,
                model.tensor_digests,
                plans,
                ["test:r0", "test:r1"],
                spares=pool,
            )

        first = build()
        deadline = time.monotonic() + 120
        while pool.prepared_total < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # prepared in the background, off the build's path
        assert pool.prepared_total == 2
        second = build()
        assert pool.taken_total == 2
        for a, b in zip(first, second, strict=True):
            assert a.entries == b.entries and a.size == b.size
            assert a.mapping[:] == b.mapping[:]
            assert os.fstat(b.fd).st_size == b.size
            assert fcntl.fcntl(b.fd, fcntl.F_GET_SEALS) == PACK_SEALS
        for p in first + second:
            assert p.settled.wait(120)
            p.close()
    finally:
        pool.close()
        model.store.close()
    deadline = time.monotonic() + 120
    while pool.prepared_total < 4 and time.monotonic() < deadline:
        time.sleep(0.05)  # the second build's spares: prepared (or refused: closed)
    assert _open_fds() - before == set()
