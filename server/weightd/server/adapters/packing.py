"""Adapter rank packs: one adapter version's rank slices in a sealed memfd, like base packs.

Why the same packs: a worker on the daemon's host maps its base weights from shared
memory (or opens them by CUDA IPC); its adapters should come the same way, share the
same budget and obey the same lease rules. What differs is what a pack depends on:

* the **key** is (adapter name, version, world size, rank), so a replace (a new
  version) gets a new pack and a worker still mapping the old one keeps it intact;
* a pack **lease also holds the adapter version** in the registry (a hold, as every
  claim that keeps a version is called; a lease is a claim on a pack's memory)
  (:class:`AdapterPackLease`), so an unload or replace never lets go of a version a
  worker maps; the lease ends with the worker's side-channel connection;
* when the registry lets a version go (retired and unheld), its packs are freed at
  once rather than at the end of their TTL (:func:`adapter_key_matches`): nobody can
  ask for that version again.

The bytes come from the verified in-memory copy of the adapter's weights file, cut by
the same pure plan as the gRPC stream; entries carry the BLAKE3 digests taken at load
(see :func:`build_adapter_pack` for why that check still holds), and the sealed pack
is re-hashed against them before it is published.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import blake3

from weightd.common.digests import ADAPTER_WEIGHTS_FILE, BLAKE3, slice_digest

from ..packs import cache as pack_cache
from ..packs.build import HostPack, build_pack
from ..plan.slices import TensorSlice
from .plan import AdapterSlicePlan
from .registry import AdapterHold, AdapterVersion


@dataclass(frozen=True, slots=True)
class AdapterTag:
    """Which adapter version a pack holds, as the grant and the stats report it."""

    name: str
    version: int
    digest: str
    base_model: str
    scaling: tuple[tuple[str, float], ...]
    #: adapter_config.json as verified and the weights file's SHA-256 hex: with them a
    #: same-host engine (vLLM) builds the adapter from the pack, PEFT's settings byte for
    #: byte, and checks both against ``digest`` (``adapter_digest``).
    config: bytes = b""
    weights_sha256: str = ""


def adapter_tag(v: AdapterVersion, plan: AdapterSlicePlan) -> AdapterTag:
    a = v.adapter
    return AdapterTag(
        v.name,
        v.version,
        a.digest,
        a.base_model,
        tuple(plan.scaling.items()),
        a.config_data,
        a.file_sha256.get(ADAPTER_WEIGHTS_FILE, ""),
    )


def adapter_key(name: str, version: int, world_size: int, rank: int) -> tuple[object, ...]:
    """The pack cache key of an adapter pack (base packs' keys never start with "adapter")."""
    return ("adapter", name, version, world_size, rank)


def adapter_key_matches(name: str, version: int) -> Callable[[Hashable], bool]:
    """A predicate for the cache keys of every pack of ``version`` of ``name``."""

    def match(key: Hashable) -> bool:
        return isinstance(key, tuple) and key[:3] == ("adapter", name, version)

    return match


def slice_bytes(v: AdapterVersion, s: TensorSlice) -> tuple[bytes, str]:
    """The bytes of slice ``s`` cut from the verified adapter, and their SHA-256 digest."""
    data = v.adapter.read(s.pattern)
    return data, slice_digest(hashlib.sha256(data))


def load_digests(v: AdapterVersion) -> dict[tuple[int, int], str]:
    """The BLAKE3 digest taken at load of each tensor, by its ``(offset, nbytes)`` in the file."""
    digests = v.adapter.tensor_digests
    return {
        (t.offset, t.nbytes): digests[t.name]
        for m in v.adapter.modules
        for t in (m.a, m.b)
        if t.name in digests
    }


def build_adapter_pack(v: AdapterVersion, plan: AdapterSlicePlan, label: str) -> HostPack:
    """The sealed, re-verified pack of ``plan`` (a rank's slices of version ``v``).

    Each entry carries a BLAKE3 digest, and the sealed pack is re-hashed against it
    (:func:`~weightd.server.packs.build.build_pack` hashes each entry by its own kind).
    A whole tensor's digest is the one :func:`~.load.load_adapter` took at load from
    the same immutable bytes whose SHA-256 it checked against the adapter's digest, so
    it needs no pass of its own here: a pack whose bytes hash to it holds exactly the
    verified bytes (BLAKE3 is a cryptographic hash, as SHA-256 is). Only a slice cut
    from a tensor (TP > 1) is hashed here, from those same verified bytes. Clients that
    check BLAKE3 (every vLLM worker with the ``blake3`` package) then re-check the
    mapping at BLAKE3's speed; others get SHA-256 digests hashed from the sealed pack
    (:meth:`~weightd.server.packs.build.HostPack.digests`). A new adapter's first request
    (vLLM's shared hand-over) waits for this build, or finds it built at load
    (:func:`prebuild`).
    """
    data = memoryview(v.adapter.data)
    known = load_digests(v)

    def digest(s: TensorSlice) -> str:
        runs = list(s.pattern.ranges())
        if len(runs) == 1 and runs[0] in known:
            return known[runs[0]]
        h = blake3.blake3()
        for off, n in runs:
            h.update(data[off : off + n])
        return slice_digest(h, BLAKE3)

    def fill(s: TensorSlice, into: memoryview) -> None:
        at = 0
        for off, n in s.pattern.ranges():
            into[at : at + n] = data[off : off + n]
            at += n

    # blake3 releases the GIL on large buffers: cut slices hash on every core.
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1), "weightd-adapter-hash") as pool:
        digests = list(pool.map(digest, plan.slices))
    return build_pack(plan.slices, digests, fill, label)


class AdapterPackLease:
    """A pack lease and the registry's hold on the version it holds, released together.

    Order matters: the pack is released first (it becomes idle), then the version; if
    that was the version's last hold and it is retired, the registry's drop callback
    finds the pack idle and frees it.
    """

    def __init__(self, pack: pack_cache.Lease[Any], version: AdapterHold) -> None:
        self._pack = pack
        self._version = version
        self.pack: object = pack.pack  # a HostPack, or its GPU copy
        self.pack_id = pack.pack_id
        self.info = pack.info
        self.built = pack.built

    def release(self) -> None:
        try:
            self._pack.release()
        finally:
            self._version.release()
