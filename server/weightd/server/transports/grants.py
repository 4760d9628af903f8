"""What the side channel hands out: pack records, leases held, and the grants written from them.

:class:`PackInfo` is what a cached pack is recorded as, :data:`Held` is the lease a
connection keeps, and :func:`answer` writes a lease down as the ``PackGrant`` (with
its table of entries) that a client attaches from.

Why apart from :mod:`.local_service`: that module decides *which* pack a request gets
(resolve, plan, key, cache, place, lease); this one is only the wire form of the
result, the contract the client's attach code reads, so it can be read and changed
in one place without the caching logic around it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from weightd.common.digests import SLICE_DIGEST_ALGORITHM, SLICE_DIGEST_KINDS
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

from ..adapters.packing import AdapterPackLease, AdapterTag
from ..packs.build import HostPack, PackEntry
from ..packs.cache import Lease
from ..weights.layouts import Layout
from .cuda_ipc import CudaPack


@dataclass(frozen=True, slots=True)
class PackInfo:
    """What stats report about a pack (its key holds the model fingerprint instead)."""

    model: str
    layout: Layout
    placement: lpb.Placement.ValueType
    gpu_uuid: str = ""
    adapter: AdapterTag | None = None  # an adapter pack: the version it holds
    declared: bool = False  # built at load for a declared (or remembered) layout


#: A lease the side socket holds for a connection: on a base pack, or on an adapter
#: pack together with its adapter version.
Held = Lease[HostPack] | Lease[CudaPack] | AdapterPackLease


@dataclass
class Outcome:
    """An answer, the descriptors to pass with it, and the lease the connection now holds."""

    response: lpb.LocalResponse
    fds: list[int]
    lease: Held | None = None


def _entry(e: PackEntry, digest: str) -> lpb.PackEntry:
    return lpb.PackEntry(
        name=e.name,
        dtype=e.dtype,
        shape=e.shape,
        offset=e.offset,
        nbytes=e.nbytes,
        digest=digest,
        split_dim=e.split_dim,
        replicated=e.replicated,
    )


#: Each pack's whole table (per digest kind), as the wire bytes of a ``PackGrant``
#: holding only its entries. Why: a pack's table never changes, and building its
#: messages field by field was the largest part of answering a shared-memory request,
#: and merging the cached bytes costs a small fraction of that. Weakly keyed: an evicted
#: pack's table goes with it.
_TABLES: weakref.WeakKeyDictionary[HostPack | CudaPack, dict[str, bytes]] = (
    weakref.WeakKeyDictionary()
)
_TABLES_LOCK = threading.Lock()


def digest_kind(pack: HostPack | CudaPack, accepted: Sequence[str]) -> str:
    """The slice digest kind a grant's entries carry: the pack's own when the client
    accepts it, else the first the client names; SHA-256 for clients that name none
    (they predate ``AcquirePack.slice_digests`` and check only SHA-256)."""
    native = pack.entries[0].digest.partition(":")[0] if pack.entries else SLICE_DIGEST_ALGORITHM
    if not accepted:
        return SLICE_DIGEST_ALGORITHM
    if native in accepted:
        return native
    for kind in accepted:
        if kind in SLICE_DIGEST_KINDS:
            return kind
    return SLICE_DIGEST_ALGORITHM


def _digests(pack: HostPack | CudaPack, kind: str) -> tuple[str, ...]:
    if isinstance(pack, HostPack):
        return pack.digests(kind)
    return tuple(e.digest for e in pack.entries)  # a GPU copy keeps its host pack's table


def _whole_table(pack: HostPack | CudaPack, kind: str) -> bytes:
    with _TABLES_LOCK:
        table = _TABLES.get(pack, {}).get(kind)
    if table is None:
        entries = [_entry(e, d) for e, d in zip(pack.entries, _digests(pack, kind), strict=True)]
        table = lpb.PackGrant(entries=entries).SerializeToString()
        with _TABLES_LOCK:
            _TABLES.setdefault(pack, {})[kind] = table
    return table


def _add_entries(
    grant: lpb.PackGrant, pack: HostPack | CudaPack, names: list[str], kind: str
) -> None:
    """Append the entries for ``names`` (all, in pack order, when empty) to ``grant``."""
    if not names:
        grant.MergeFromString(_whole_table(pack, kind))  # repeated fields append
        return
    digests = dict(zip((e.name for e in pack.entries), _digests(pack, kind), strict=True))
    by_name = {e.name: e for e in pack.entries}
    # names were checked by the planner
    grant.entries.extend(_entry(by_name[n], digests[n]) for n in names)


def wire_layout(layout: Layout) -> pb.Layout:
    """The wire form of a pack's layout, every field set (grants and stats)."""
    return pb.Layout(
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
        pp_size=layout.pp_size,
        pp_rank=layout.pp_rank,
        ep_size=layout.ep_size,
        ep_rank=layout.ep_rank,
        pp_layers=layout.pp_layers,
        vocab_pad=layout.vocab_pad,
    )


def answer(boot_id: str, lease: Held, names: list[str], accepted: Sequence[str] = ()) -> Outcome:
    """The grant for a lease (entries for ``names``, or all), with what it must carry.

    ``accepted``: the slice digest kinds the client can check (see :func:`digest_kind`).
    """
    info = lease.info
    assert isinstance(info, PackInfo)
    pack = lease.pack
    assert isinstance(pack, HostPack | CudaPack)
    grant = lpb.PackGrant(
        boot_id=boot_id,
        pack_id=lease.pack_id,
        model=info.model,
        layout=wire_layout(info.layout),
        placement=info.placement,
        size_bytes=pack.size,
        built=lease.built,
    )
    _add_entries(grant, pack, names, digest_kind(pack, accepted))
    if info.adapter is not None:
        tag = info.adapter
        grant.adapter.CopyFrom(
            pb.AdapterInfo(
                name=tag.name,
                version=tag.version,
                digest=tag.digest,
                base_model=tag.base_model,
                scaling=dict(tag.scaling),
                config=tag.config,
                weights_sha256=tag.weights_sha256,
            )
        )
    if isinstance(pack, HostPack):
        grant.pinned = pack.pinned
        grant.huge_pages = pack.huge
        return Outcome(lpb.LocalResponse(grant=grant), [pack.fd], lease)
    grant.cuda_ipc_handle = pack.handle
    grant.gpu_uuid = pack.gpu_uuid
    return Outcome(lpb.LocalResponse(grant=grant), [], lease)
