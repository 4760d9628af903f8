"""Grants in process: the cached wire table, the huge-page flag, and what the client does with it.

A real sealed pack built from the demo checkpoint, leased from a real ``PackCache``,
written down by the daemon's :func:`answer` and mapped by the client's
:func:`map_host_pack`, with nothing in between but the grant message itself.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from weightd.client import Delivery
from weightd.client.transports import shm
from weightd.server.packs.build import HostPack, PackEntry, layout_pack
from weightd.server.packs.cache import Lease, PackCache
from weightd.server.packs.layoutbuild import build_host_pack
from weightd.server.registry.models import load_model
from weightd.server.transports.grants import PackInfo, answer
from weightd.v1 import local_pb2 as lpb


def _expected_entry(e: PackEntry) -> lpb.PackEntry:
    return lpb.PackEntry(
        name=e.name,
        dtype=e.dtype,
        shape=e.shape,
        offset=e.offset,
        nbytes=e.nbytes,
        digest=e.digest,
        split_dim=e.split_dim,
        replicated=e.replicated,
    )


@pytest.fixture(params=["never", "always"])
def leased(
    request: pytest.FixtureRequest, demo_model: Path
) -> Iterator[tuple[PackCache[HostPack], Lease[HostPack]]]:
    """A lease on a real pack, built as in a host whose shmem mode is the param."""
    model = load_model(str(demo_model))
    ids = itertools.count(1)
    cache: PackCache[HostPack] = PackCache("host", 1 << 30, 60, lambda: next(ids))
    plan = model.plan(2, 1)
    sized: list[int] = []

    def size() -> int:
        sized.append(1)
        return layout_pack(plan.slices)[1]

    def build() -> HostPack:
        return build_host_pack(model, plan, "test:tp2:r1", huge_mode=request.param)

    info = PackInfo("demo", plan.layout, lpb.PLACEMENT_HOST)
    lease = cache.acquire(("demo", plan.layout), size, info, build)
    again = cache.acquire(("demo", plan.layout), size, info, build)
    assert sized == [1]  # laid out for the build only; the hit never computes the size
    assert again.pack is lease.pack and not again.built
    again.release()
    try:
        yield cache, lease
    finally:
        lease.release()
        cache.close()
        model.store.close()


def test_whole_table_and_named_entries_are_the_packs_table(
    leased: tuple[PackCache[HostPack], Lease[HostPack]],
) -> None:
    _, lease = leased
    pack = lease.pack
    want = [_expected_entry(e) for e in pack.entries]
    for _ in range(2):  # the second answer comes from the cached table
        grant = answer("boot", lease, [], ["blake3", "sha256"]).response.grant
        assert list(grant.entries) == want
        assert grant.size_bytes == pack.size and grant.pack_id == lease.pack_id
        assert grant.huge_pages is pack.huge
    # A client that names no kind predates the choice and checks SHA-256: its table is
    # hashed from the sealed pack, every entry the SHA-256 of exactly its bytes.
    for _ in range(2):
        old = answer("boot", lease, []).response.grant
        for e, got in zip(pack.entries, old.entries, strict=True):
            region = pack.mapping[e.offset : e.offset + e.nbytes]
            assert got.digest == "sha256:" + hashlib.sha256(region).hexdigest(), e.name
            assert got.name == e.name and got.offset == e.offset
    names = [e.name for e in reversed(pack.entries)][:3]
    named = answer("boot", lease, names, ["blake3"]).response.grant
    assert [e.name for e in named.entries] == names  # in the order asked, only those
    assert list(named.entries) == [w for n in names for w in want if w.name == n]


class _Conn:
    """What ``map_host_pack`` needs of the lease's connection: that it can be closed."""

    closed = False

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("asked", [None, False, True])
def test_client_populates_by_default_exactly_the_packs_granted_in_huge_pages(
    leased: tuple[PackCache[HostPack], Lease[HostPack]],
    asked: bool | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, lease = leased
    pack = lease.pack
    grant = answer("boot", lease, []).response.grant
    populated: list[int] = []
    real = shm._populate

    def spy(mapping: mmap.mmap) -> bool:
        populated.append(1)
        return real(mapping)

    monkeypatch.setattr(shm, "_populate", spy)
    conn = _Conn()
    # verify: every slice against the table: the mapping holds the pack's bytes
    delivery = Delivery(device=torch.device("cpu"), verify=True, populate=asked)
    views = shm.map_host_pack(grant, os.dup(pack.fd), conn, delivery)
    assert populated == ([1] if (pack.huge if asked is None else asked) else [])
    assert sorted(views) == sorted(e.name for e in pack.entries)
    for e in pack.entries:
        got = views[e.name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        assert got == pack.mapping[e.offset : e.offset + e.nbytes], e.name
    assert not conn.closed  # the tensors hold the lease
    views.clear()
    gc.collect()
    assert conn.closed  # the last view gone: the lease ends
