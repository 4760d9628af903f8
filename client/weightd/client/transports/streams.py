"""One rank fetched over several concurrent Fetch streams (``fetch(..., streams=N)``).

Why: one Python gRPC stream is bound by one thread on each side (parsing, copying and
hashing its messages; gRPC's own per-stream work), while a worker on a many-core host
or behind a fast NIC could take more. The rank's tensors
are split into N groups of about equal bytes, each group is one ordinary Fetch
request naming its tensors (``FetchRequest.names``: no wire change, so it works with
every daemon), received on its own thread and its own connection, and the results are
merged. Each stream is checked, retried and resumed exactly as a single one is; the
fetch fails as a whole if any stream fails (the others are cancelled at their next
tensor), so a partial rank is never returned.

What bounds it: each stream holds one of the daemon's RPC slots and threads
(``--max-workers``, ``--max-concurrent-rpcs``), the client's GIL between the copies and
hashes that release it, and the cores both sides share (with two cores, N > 2 cannot
help: see the gRPC notebook in ``docs/notes/``).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..base.errors import WeightdError

if TYPE_CHECKING:  # torch loads only where tensors are made (`weightd list` needs none)
    import torch

    from ..receive.stream import ProgressFn
    from .resumable import ResumeReport

#: Most streams one fetch may open: each holds a daemon RPC slot and a thread.
MAX_STREAMS = 16


def split_by_bytes(sizes: Sequence[tuple[str, int]], n: int) -> list[list[str]]:
    """``sizes`` (name, bytes) in at most ``n`` groups of near-equal bytes (pure).

    Largest first into the lightest group (deterministic: ties go to the lower group);
    each group keeps the input's order, and no group is empty.
    """
    n = max(1, min(n, len(sizes)))
    heap = [(0, g) for g in range(n)]
    owner: dict[str, int] = {}
    for name, size in sorted(sizes, key=lambda item: -item[1]):
        load, g = heapq.heappop(heap)
        owner[name] = g
        heapq.heappush(heap, (load + size, g))
    groups: list[list[str]] = [[] for _ in range(n)]
    for name, _ in sizes:
        groups[owner[name]].append(name)
    return [g for g in groups if g]


class _SiblingFailed(WeightdError):
    code_name = "CANCELLED"


def fetch_in_streams(
    groups: Sequence[list[str]],
    fetch_group: Callable[[int, list[str], ProgressFn], dict[str, torch.Tensor]],
    on_tensor: ProgressFn | None,
) -> dict[str, torch.Tensor]:
    """Run ``fetch_group(i, names, progress)`` for every group at once; merge, in order.

    The first failure is raised once every stream has stopped; a stream still running
    then stops at its next complete tensor (its call is cancelled).
    """
    failed = threading.Event()
    lock = threading.Lock()

    def progress(index: int, name: str) -> None:
        if failed.is_set():
            raise _SiblingFailed("another stream of this fetch failed")
        if on_tensor is not None:
            with lock:
                on_tensor(index, name)

    def run(i: int) -> dict[str, torch.Tensor]:
        try:
            return fetch_group(i, groups[i], progress)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(len(groups), thread_name_prefix="weightd-fetch") as pool:
        futures = [pool.submit(run, i) for i in range(len(groups))]
        errors = [f.exception() for f in futures]
    real = [e for e in errors if e is not None and not isinstance(e, _SiblingFailed)]
    if real:
        raise real[0]
    out: dict[str, torch.Tensor] = {}
    for f in futures:
        out.update(f.result())
    return out


def merge_reports(reports: Sequence[ResumeReport]) -> ResumeReport:
    """One report for a fetch made of several streams (kinds: the first stream's)."""
    from .resumable import ResumeReport

    merged = ResumeReport()
    for r in reports:
        merged.streams += r.streams
        merged.resumed_at += r.resumed_at
        merged.restarts += r.restarts
        merged.rechecks += r.rechecks
        merged.received_bytes += r.received_bytes
        merged.resent_bytes += r.resent_bytes
    merged.slice_digest = reports[0].slice_digest if reports else ""
    return merged
