"""A trainer's tensors in sealed shared memory become a version, checked as a load is.

The region a trainer hands over (a memfd it filled and sealed, or one the daemon
filled from a gRPC stream and sealed itself) holds one safetensors file: the 8-byte
header length, the JSON header, the data. :func:`version_from_memory` turns it into a
:class:`~.models.LoadedModel` that serves like any other:

* **sealed, bounded**: ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE`` must be set
  (:func:`check_sealed`), so no process (the trainer included) can change or truncate
  a byte after it was hashed: a truncation cannot SIGBUS the daemon's readers and the
  digests keep describing the bytes served. Its size is bounded by the serving
  version's (:func:`size_limit`) before anything is read;
* **parsed strictly** by the daemon's own safetensors parser
  (:func:`~weightd.server.checkpoint.header.parse_header`);
* **the same tensors as the serving version**: the same set of names, each with the
  same shape and dtype (:func:`check_against`); the version's ``config.json`` is the
  serving version's, so the rules, the plans and every layout in use still hold;
* **hashed once**: every tensor's BLAKE3 (what slices are anchored to) from one pass
  over the region, by the same code that hashes shards at load.

The region is the version's one shard: the store reads it by ``pread`` like a file,
and closes it when the version is dropped (the memory goes with its last reference).
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Iterator, Mapping
from typing import Final

from ..base.cleanup import on_error
from ..base.errors import (
    HeaderError,
    MemoryPublishUntrusted,
    PublishAborted,
    PublishRefused,
    echo,
)
from ..checkpoint.description import Checkpoint, TensorInfo
from ..checkpoint.header import MAX_HEADER_BYTES, header_length, parse_header
from ..plan.builtin_rules import rules_for
from ..store.shards import ShardStore
from ..trust.integrity import SliceAnchors, hash_checkpoint
from ..trust.verify import VerifyOptions
from .models import LoadedModel

#: What a version from memory names as its root (``VersionInfo.source``), and its shard.
MEMORY_ROOT: Final = "memory://"
MEMORY_SHARD: Final = "model.safetensors"
#: The seals a region must carry (``F_SEAL_SEAL`` too is welcome, not required).
REQUIRED_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
#: Header bytes allowed per tensor of the serving version, on top of a fixed allowance
#: (a header entry takes ~120 bytes; names up to 1024 characters).
HEADER_BYTES_PER_TENSOR: Final = 1280
HEADER_BYTES_BASE: Final = 64 << 10


def memory_root(name: str) -> str:
    return f"{MEMORY_ROOT}{name}"


def is_memory_source(source: str) -> bool:
    return source.startswith(MEMORY_ROOT)


def size_limit(current: LoadedModel) -> int:
    """The most bytes a region for a new version of ``current`` may hold: its tensors'
    bytes (they must match exactly) plus a header for as many tensors."""
    n = len(current.checkpoint.tensors)
    header = min(MAX_HEADER_BYTES, HEADER_BYTES_BASE + HEADER_BYTES_PER_TENSOR * n)
    return 8 + header + current.checkpoint.total_bytes


def check_trust(options: VerifyOptions | None, name: str) -> None:
    """Where the operator requires versions proved by a manifest, a signature or the
    Hugging Face cache, a trainer's memory (which carries none) is refused."""
    if options is None:
        return
    required = [
        what
        for what, needed in (
            ("a manifest", options.manifest_for(name) is not None),
            ("a signature", bool(options.trust_keys) or options.signature_for(name) is not None),
            ("a Hugging Face cache snapshot", options.trust_hf_cache),
        )
        if needed
    ]
    if required:
        raise MemoryPublishUntrusted(
            f"model {echo(name)}: this daemon requires every version to be proved by "
            f"{' and '.join(required)}; a trainer's memory carries no such proof: publish "
            "a directory with its manifest instead",
            model=name,
        )


def check_sealed(fd: int, limit: int) -> int:
    """The region's size, once it is proven a sealed regular memory file of at most
    ``limit`` bytes; :class:`PublishRefused` otherwise."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PublishRefused("the descriptor handed over is not a memory file (memfd)")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise PublishRefused(
            "the descriptor handed over is not a memfd created with MFD_ALLOW_SEALING"
        ) from None
    missing = REQUIRED_SEALS & ~seals
    if missing:
        names = [
            n
            for n, bit in (
                ("F_SEAL_SHRINK", fcntl.F_SEAL_SHRINK),
                ("F_SEAL_GROW", fcntl.F_SEAL_GROW),
                ("F_SEAL_WRITE", fcntl.F_SEAL_WRITE),
            )
            if missing & bit
        ]
        raise PublishRefused(
            f"the memfd handed over is not sealed (missing {', '.join(names)}): the trainer "
            "could still change bytes after the daemon hashed them",
            got=f"seals {seals:#x}",
            expected=f"seals including {REQUIRED_SEALS:#x}",
        )
    if st.st_size > limit:
        raise PublishRefused(
            f"the memfd holds {st.st_size} bytes, more than a version of this model can "
            f"({limit}: its tensors and their header)",
            got=str(st.st_size),
            expected=f"at most {limit}",
        )
    return int(st.st_size)


def _describe(shape: tuple[int, ...], dtype: str) -> str:
    return f"{dtype}{list(shape)}"


def check_against(
    name: str, entries: Mapping[str, tuple[str, tuple[int, ...]]], current: Checkpoint
) -> None:
    """``entries`` (tensor name → dtype, shape) are exactly ``current``'s tensors, or
    :class:`PublishRefused` names the first that is not: missing, extra, another shape,
    another dtype, with what it got and what was expected."""
    for t in current.tensors.values():
        got = entries.get(t.name)
        if got is None:
            raise PublishRefused(
                f"model {echo(name)}: tensor {echo(t.name)} is missing from the published "
                f"tensors (the serving version has it as {_describe(t.shape, t.dtype)})",
                tensor=t.name,
                got="missing",
                expected=_describe(t.shape, t.dtype),
            )
        dtype, shape = got
        if shape != t.shape:
            raise PublishRefused(
                f"model {echo(name)}: tensor {echo(t.name)} has shape {list(shape)}, "
                f"expected {list(t.shape)} (the serving version's)",
                tensor=t.name,
                got=str(list(shape)),
                expected=str(list(t.shape)),
            )
        if dtype != t.dtype:
            raise PublishRefused(
                f"model {echo(name)}: tensor {echo(t.name)} has dtype {dtype}, expected "
                f"{t.dtype} (the serving version's)",
                tensor=t.name,
                got=dtype,
                expected=t.dtype,
            )
    extra = sorted(set(entries) - set(current.tensors))
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise PublishRefused(
            f"model {echo(name)}: tensor {echo(extra[0])}{more} is not a tensor of the model "
            "(the serving version has no such name)",
            tensor=extra[0],
            got=_describe(entries[extra[0]][1], entries[extra[0]][0]),
            expected="no such tensor",
        )


def version_from_memory(fd: int, current: LoadedModel, threads: int | None = None) -> LoadedModel:
    """A verified, unpublished version of ``current``'s model whose one shard is the
    sealed region ``fd``. Takes ``fd`` over: it is closed on any failure, and by the
    version's store once it is dropped."""
    name = current.name
    root = memory_root(name)
    path = f"{root}/{MEMORY_SHARD}"
    with on_error(lambda: os.close(fd), f"the memfd of {name}'s publish"):
        size = check_sealed(fd, size_limit(current))
        try:
            length = header_length(path, os.pread(fd, 8, 0), size)
            raw = os.pread(fd, length, 8)
            if len(raw) != length:
                raise PublishRefused(f"the memfd's header ends early ({len(raw)} of {length})")
            header = parse_header(path, raw, size)
        except HeaderError as exc:
            raise PublishRefused(f"the published tensors' header is not valid: {exc}") from None
        check_against(
            name, {e.name: (e.dtype, e.shape) for e in header.entries}, current.checkpoint
        )
        store = ShardStore.of_descriptor(root, MEMORY_SHARD, fd)
    with on_error(store.close, f"the memfd of {name}'s publish"):
        ckpt = current.checkpoint
        tensors = {
            e.name: TensorInfo(
                e.name, e.dtype, e.shape, MEMORY_SHARD, header.data_start + e.begin, e.nbytes
            )
            for e in header.entries
        }
        new = Checkpoint(
            name=name,
            root=root,
            config=ckpt.config,
            config_json=ckpt.config_json,
            tensors=tensors,
            shards=(MEMORY_SHARD,),
            metadata=dict(header.metadata),
        )
        digests = hash_checkpoint(new, store, threads)
        return LoadedModel(
            new,
            store,
            rules_for(new.config, current.tables),
            digests,
            SliceAnchors(store, digests),
            tables=current.tables,
            trust=("published from a trainer's memory (sealed memfd), over the admin channel",),
            trust_root="admin",
            from_memory=True,
        )


#: The name of a memfd the daemon fills from a PublishTensors stream (``/proc/<pid>/fd``
#: shows ``/memfd:weightd-publish (deleted)``; packs carry their layout's label).
STREAM_MEMFD_NAME: Final = "weightd-publish"


def region_from_chunks(total: int, limit: int, chunks: Iterator[bytes]) -> int:
    """A sealed memfd holding exactly ``total`` bytes from ``chunks`` (a gRPC stream's),
    at most ``limit``: the daemon's own region, so no other process holds it. Closed on
    any failure (a short or long stream, a broken one)."""
    if total > limit:
        raise PublishRefused(
            f"the stream announces {total} bytes, more than a version of this model can "
            f"hold ({limit}: its tensors and their header)",
            got=str(total),
            expected=f"at most {limit}",
        )
    fd = os.memfd_create(STREAM_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    with on_error(lambda: os.close(fd), "the memfd of a PublishTensors stream"):
        written = 0
        for data in chunks:
            if written + len(data) > total:
                raise PublishRefused(
                    f"the stream sent more than the {total} bytes its first chunk announced",
                    got=f"more than {total}",
                    expected=str(total),
                )
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            written += len(data)
        if written != total:
            raise PublishAborted(
                f"the stream ended after {written} of the {total} bytes it announced"
            )
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
    return fd
