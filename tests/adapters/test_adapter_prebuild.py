"""Adapter packs built at load, carrying the BLAKE3 digests taken at load.

A version's TP=1 pack (what a same-host vLLM engine maps) is built when the version is
loaded, so its first request finds it built; its entries carry the load's BLAKE3
tensor digests (no second hashing pass), and the sealed pack is still re-hashed against
them: bytes that differ from the verified ones are refused, never published."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.lora_adapters import digest_of
from tests.adapters.conftest import Fixture
from tests.conftest import RunningDaemon, run_daemon
from weightd.client.api.admin import AdminClient
from weightd.client.transports.local import local_stats
from weightd.client.transports.selection import side_socket_path
from weightd.server.adapters.load import load_adapter
from weightd.server.adapters.packing import build_adapter_pack
from weightd.server.adapters.plan import AdapterSlicePlan, plan_adapter
from weightd.server.adapters.registry import AdapterVersion
from weightd.server.base.errors import DataIntegrityError
from weightd.server.checkpoint.scan import load_checkpoint
from weightd.v1 import local_pb2 as lpb
from weightd.vllm.lora.shared import SharedVersion, _acquire, map_adapter


def _loaded(lora: Fixture) -> AdapterVersion:
    base, _ = load_checkpoint(str(lora.base_dir))
    return AdapterVersion("good", 1, load_adapter(str(lora.adapter_dir), [str(lora.root)], base))


def _plan(lora: Fixture, v: AdapterVersion) -> AdapterSlicePlan:
    base, _ = load_checkpoint(str(lora.base_dir))
    return plan_adapter(v.adapter.modules, base, None, 1, 0)


def test_pack_entries_carry_the_loads_blake3_digests(lora: Fixture) -> None:
    v = _loaded(lora)
    plan = _plan(lora, v)
    pack = build_adapter_pack(v, plan, "test-prebuild")
    try:
        loaded = set(v.adapter.tensor_digests.values())
        assert pack.entries and all(e.digest.startswith("blake3:") for e in pack.entries)
        # Whole tensors at TP=1: each entry's digest is one taken at load, not a new pass.
        assert {e.digest for e in pack.entries} <= loaded
        # SHA-256 clients still get SHA-256 digests, hashed from the sealed pack.
        assert all(d.startswith("sha256:") for d in pack.digests("sha256"))
    finally:
        pack.close()


def test_a_byte_differing_from_the_verified_ones_is_refused(lora: Fixture) -> None:
    v = _loaded(lora)
    plan = _plan(lora, v)
    at = next(iter(plan.slices[len(plan.slices) // 2].pattern.ranges()))[0] + 3
    data = bytearray(v.adapter.data)
    data[at] ^= 0x01
    bad = AdapterVersion(
        "good", 1, dataclasses.replace(v.adapter, data=bytes(data))
    )  # the load's digests, other bytes
    with pytest.raises(DataIntegrityError, match="hash to blake3:"):
        build_adapter_pack(bad, plan, "test-prebuild-bad")


@pytest.fixture(scope="module")
def daemon(lora: Fixture, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("prebuild")
    with run_daemon(tmp, [("tiny-llama", lora.base_dir)], ["--adapter-root", str(lora.root)]) as d:
        d.admin = f"unix://{tmp / 'run' / 'admin.sock'}"  # type: ignore[attr-defined]
        yield d


def _packs(d: RunningDaemon, name: str) -> list[lpb.PackStat]:
    side = side_socket_path(d.target)
    assert side is not None
    return [p for p in local_stats(side).packs if p.adapter == name]


@pytest.mark.e2e
def test_a_loaded_versions_pack_exists_before_any_request(
    daemon: RunningDaemon, lora: Fixture, tmp_path: Path
) -> None:
    with AdminClient(daemon.admin, timeout=60) as admin:  # type: ignore[attr-defined]
        admin.load_adapter("good", str(lora.adapter_dir), model="tiny-llama")
    # Built by the load, before it answered: there before anything asked for it.
    (pack,) = _packs(daemon, "good")
    assert (pack.layout.tp_size, pack.layout.tp_rank, pack.leases) == (1, 0, 0)
    wanted = SharedVersion("good", pack.adapter_version, digest_of(lora.adapter_dir))
    conn, grant, fds = _acquire(daemon.target, wanted, 60)
    try:
        # The first request leases the pack built at load; a BLAKE3 client gets BLAKE3.
        assert not grant.built and grant.pack_id == pack.pack_id
        assert grant.entries and all(e.digest.startswith("blake3:") for e in grant.entries)
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()
    mapped = map_adapter(daemon.target, wanted, timeout=60, max_bytes=1 << 30)
    assert mapped.pack_id == pack.pack_id and not mapped.built
