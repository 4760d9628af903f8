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
the same pure plan as the gRPC stream, and each slice's SHA-256 is computed from those
bytes before the sealed pack is re-hashed against it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from weightd.common.digests import ADAPTER_WEIGHTS_FILE, slice_digest

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


def build_adapter_pack(v: AdapterVersion, plan: AdapterSlicePlan, label: str) -> HostPack:
    """The sealed, re-verified pack of ``plan`` (a rank's slices of version ``v``).

    Each slice is hashed (on every core) and copied straight from the verified bytes'
    runs, with no joined copy in between: a new adapter's first request (vLLM's shared
    hand-over) waits for this build.
    """
    data = memoryview(v.adapter.data)

    def digest(s: TensorSlice) -> str:
        h = hashlib.sha256()
        for off, n in s.pattern.ranges():
            h.update(data[off : off + n])
        return slice_digest(h)

    def fill(s: TensorSlice, into: memoryview) -> None:
        at = 0
        for off, n in s.pattern.ranges():
            into[at : at + n] = data[off : off + n]
            at += n

    # hashlib releases the GIL on large buffers: the slices hash on every core.
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
