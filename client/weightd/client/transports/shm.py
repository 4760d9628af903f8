"""Shared-memory rank packs on the client: map the daemon's sealed memfd, view tensors in it.

Mapping, not copying: every process that fetches the same rank maps the same pages,
so ten workers on a host hold one copy, and a fetch costs a hand-off and page-table
set-up instead of a copy through fresh memory (a page fault per 4 KiB page).

The memfd arrives over the side socket with ``SCM_RIGHTS``. Before mapping it the
client checks with ``F_GET_SEALS`` that it can no longer shrink, grow or be written
(by anyone, the daemon included): then its bytes are exactly those the daemon
re-hashed against the anchored digests before publishing, a truncation cannot SIGBUS
us, and there is nothing to re-verify. Hashing every byte would cost far more than
the mapping and defeat zero copy, so it is opt-in (``verify=True``), checking every
slice against the table.

The mapping is ``MAP_PRIVATE`` (copy-on-write) rather than read-only: reading shares
the pack's pages like a shared mapping, and a worker that writes into a weight in
place (some engines post-process weights after loading) gets a private copy of just
the pages it touched instead of a crash (a write to a ``PROT_READ`` page is SIGSEGV),
while no other process can ever see the write. Tensors are therefore ordinary
writable tensors, and torch has nothing to warn about.

Page tables: each 4 KiB page of the mapping costs the worker a page-table entry the
first time it is touched: the whole remaining cost of a shared-memory fetch.
``populate=True`` asks the kernel to set them all up at once
(``MADV_POPULATE_READ``, Linux 5.14+; ignored where unsupported) so the fetch returns
with every page resident; in 4 KiB pages that costs about what faulting page by page
does (measured: the gRPC notebook in ``docs/notes/``), so it only moves the cost, and
such packs stay lazy by default (a worker that reads part of a rank pays for that
part). Huge pages cut the entries 512-fold: where the daemon's packs are in shmem
huge pages (``packs/hugepages.py``: advised, given by the kernel, or collapsed by the
daemon on a host at ``never``) the grant says so, and the default
(``populate=None``) populates, which then costs less than the first-touch faults
would. The mapping is made at a 2 MiB boundary
(``weightd.common.hugemap``), without which the kernel maps even a huge page 4 KiB at
a time. Never ``MAP_POPULATE``: on this writable
private mapping the kernel populates with write faults, which copy every page (seconds
and a private GiB per GiB mapped).

The lease lasts while any tensor viewing the mapping lives: a finalizer on the
mapping closes the side-channel connection when torch releases the last one.
``copy=True`` (or a non-CPU device) copies out and releases at once.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import weakref
from collections.abc import Iterable

import torch

from weightd.common.digests import slice_digest
from weightd.common.hugemap import madvise, map_aligned

from ..base.errors import DataLossError
from ..base.request import Delivery
from ..receive.dtypes import torch_dtype
from ..receive.hashers import new_hasher
from .local import LocalConnection
from .localwire import Entry, Grant

REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
#: ``MADV_POPULATE_READ`` (Linux 5.14, <asm-generic/mman-common.h>); Python 3.11's mmap
#: module does not name it.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def _populate(mapping: ctypes.Array[ctypes.c_char]) -> bool:
    """Make every page of ``mapping`` resident with read faults in the kernel, at once.

    Read faults, so a private mapping keeps sharing the pack's pages (nothing is
    copied). False where the kernel does not know the advice (nothing is changed).
    """
    try:
        madvise(mapping, MADV_POPULATE_READ)
    except OSError:
        return False
    return True


def pack_table(grant: Grant) -> list[tuple[Entry, torch.dtype, tuple[int, ...]]]:
    """Every entry checked against the pack's size and its own dtype and shape."""
    out = []
    seen: set[str] = set()
    for e in grant.entries:
        if e.name in seen:
            raise DataLossError(f"pack {grant.pack_id} lists tensor {e.name!r} twice")
        seen.add(e.name)
        dtype, shape = torch_dtype(e.dtype, tuple(e.shape))
        count = 1
        for d in shape:
            count *= d
        itemsize = dtype.itemsize
        if count * itemsize != e.nbytes:
            raise DataLossError(
                f"pack {grant.pack_id}: tensor {e.name!r} is {e.nbytes} bytes, but "
                f"{e.dtype} {list(e.shape)} holds {count * itemsize}"
            )
        if e.offset % itemsize or e.offset + e.nbytes > grant.size_bytes:
            raise DataLossError(
                f"pack {grant.pack_id}: tensor {e.name!r} at offset {e.offset} ({e.nbytes} bytes) "
                f"is misaligned or outside the {grant.size_bytes}-byte pack"
            )
        out.append((e, dtype, shape))
    return out


def check_sealed(fd: int, expected_size: int, pack_id: int) -> None:
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise DataLossError(
            f"pack {pack_id}: the descriptor is not sealed against shrinking, growing and "
            f"writing (seals {seals:#x}); refusing to map memory someone could change"
        )
    size = os.fstat(fd).st_size
    if expected_size <= 0:
        raise DataLossError(f"pack {pack_id}: the grant says the pack holds {expected_size} bytes")
    if size != expected_size:
        raise DataLossError(
            f"pack {pack_id}: memfd holds {size} bytes, the grant says {expected_size}"
        )


def map_host_pack(
    grant: Grant, fd: int, conn: LocalConnection, delivery: Delivery
) -> dict[str, torch.Tensor]:
    """Tensors for the grant's entries. Takes ownership of ``fd`` and of ``conn`` (the lease).

    ``delivery.populate``: every page resident before returning (see the module's
    docstring); None: exactly when the grant says the pack is in huge pages.
    """
    copy, verify, device = delivery.copy, delivery.verify, delivery.torch_device()
    want_populate = delivery.populate
    if want_populate is None:
        want_populate = grant.huge_pages
    try:
        check_sealed(fd, grant.size_bytes, grant.pack_id)
        table = pack_table(grant)
        # At a 2 MiB boundary, so a pack in huge pages is mapped huge even on a host
        # whose kernel would not align it by itself (shmem_enabled=never, collapsed packs).
        mapping = map_aligned(fd, grant.size_bytes, shared=False)
        if want_populate and not copy and device.type == "cpu":
            _populate(mapping)
    except BaseException:
        conn.close()
        raise
    finally:
        os.close(fd)  # the mapping keeps the memfd alive
    release = weakref.finalize(mapping, conn.close)
    views: dict[str, torch.Tensor] = {}
    try:
        for e, dtype, shape in table:
            if e.nbytes == 0:
                views[e.name] = torch.empty(shape, dtype=dtype)
                continue
            count = e.nbytes // dtype.itemsize  # pack_table checked size and alignment
            raw = torch.frombuffer(mapping, dtype=dtype, count=count, offset=e.offset)
            views[e.name] = raw.view(shape)
        if verify:
            _verify(mapping, grant.entries, grant.pack_id)
    except BaseException:
        views.clear()
        del mapping
        release()
        raise
    if not copy and device.type == "cpu":
        return views
    out = {n: t.to(device, copy=True) for n, t in views.items()}
    views.clear()
    del mapping
    release()  # nothing views the pack any more: end the lease now, not at garbage collection
    return out


def _verify(mapping: ctypes.Array[ctypes.c_char], entries: Iterable[Entry], pack_id: int) -> None:
    """Hash every entry as its digest says (``blake3:``, ``sha256:``) and compare."""
    with memoryview(mapping) as raw, raw.cast("B") as view:
        for e in entries:
            kind = e.digest.partition(":")[0]
            try:
                h = new_hasher(kind)
            except ValueError as exc:
                raise DataLossError(f"pack {pack_id}: tensor {e.name!r}: {exc}") from None
            h.update(view[e.offset : e.offset + e.nbytes])
            actual = slice_digest(h, kind)
            if actual != e.digest:
                raise DataLossError(
                    f"pack {pack_id}: tensor {e.name!r} hashes to {actual}, the table says "
                    f"{e.digest}"
                )
