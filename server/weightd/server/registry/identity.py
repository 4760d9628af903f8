"""What a client needs to prove its copy of a checkpoint is the one served, cheaply.

``DescribeModel`` lists every file the daemon verified; for each shard this adds the
identity of the very file the daemon holds open (device, inode, size, mtime: on the
same host, ``host_boot_id``, equal values mean the same file) and a sampled digest of
its tensors (``weightd.common.sampling``: a few KiB per tensor), which tells another
checkpoint of the same shapes (a fine-tune) from this one without reading either.

The samples are read through the model's own descriptors, once per served version
(cached), and the shard's identity is checked afterwards like every other read.
"""

from __future__ import annotations

import threading
import weakref
from typing import Final

from weightd.common.sampling import sample_digest

from ..base.readfile import ReadRefused, read_bounded
from .models import LoadedModel

BOOT_ID_PATH: Final = "/proc/sys/kernel/random/boot_id"

#: id(model) -> its samples; an entry goes with its model (a finalizer).
_SAMPLES: dict[int, dict[str, str]] = {}
_LOCK = threading.Lock()


def host_boot_id(path: str = BOOT_ID_PATH) -> str:
    """This boot of this host ("" where the kernel does not say)."""
    try:
        return read_bounded(path, 64).decode("ascii", "replace").strip()
    except ReadRefused:
        return ""


def shard_samples(model: LoadedModel) -> dict[str, str]:
    """Shard name -> its sampled digest, computed once per served version."""
    with _LOCK:
        found = _SAMPLES.get(id(model))
    if found is not None:
        return found
    by_shard: dict[str, list[tuple[str, int, int]]] = {s: [] for s in model.checkpoint.shards}
    for t in model.checkpoint.tensors.values():
        by_shard.setdefault(t.shard, []).append((t.name, t.offset, t.nbytes))
    out = {}
    for shard, tensors in by_shard.items():

        def read(offset: int, n: int, shard: str = shard) -> bytes:
            return model.store.read_exact(shard, offset, n)

        out[shard] = sample_digest(tensors, read)
        model.store.check(shard)
    with _LOCK:
        if id(model) not in _SAMPLES:
            _SAMPLES[id(model)] = out
            weakref.finalize(model, _SAMPLES.pop, id(model), None)
    return out
