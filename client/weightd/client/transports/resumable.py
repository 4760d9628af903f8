"""A gRPC fetch that survives a daemon restart: retried, and resumed where it was cut.

Each attempt asks for the tensors not yet held (``start_index``) and names the content
they came from (``model_fingerprint``). A daemon that now serves other content answers
ABORTED: the client then drops what it held and starts again from tensor 0, once per
attempt, so a rank is never assembled from two versions. A slice that fails the
client's digest check is asked for once more with ``rehash`` set: a daemon that does
not re-hash every stream (its default) then checks the bytes it sends itself, and
refuses them, marking the model broken, when its file changed under it. What a fetch
cost is in :class:`ResumeReport`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightd.v1 import weightd_pb2 as pb

from ..base.errors import AbortedError, DigestMismatchError
from ..base.retry import RetryPolicy, RetryStats, call_with_retry
from ..receive.stream import RankReceiver


@dataclass
class ResumeReport:
    """How one fetch went over gRPC."""

    streams: int = 0  # Fetch calls made (1: nothing was cut)
    resumed_at: list[int] = field(default_factory=list)  # start_index of each resume
    restarts: int = 0  # resumes refused because the content changed (ABORTED)
    rechecks: int = 0  # streams asked again with rehash after a slice failed its digest
    received_bytes: int = 0  # payload bytes that arrived, including any sent twice
    resent_bytes: int = 0  # payload bytes thrown away and sent again
    slice_digest: str = ""  # the kind of digest the (last) stream carried and was checked


def fetch_resumable(
    fetch: Callable[[pb.FetchRequest], Any],
    request: pb.FetchRequest,
    receiver: RankReceiver,
    *,
    policy: RetryPolicy | None,
    stats: RetryStats,
    report: ResumeReport,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``request``'s rank, digest-checked, resumed across failures.

    ``fetch``: one Fetch stream for a request (the stub's call, bounded by the
    client's timeout); ``receiver``: where the tensors go (see
    :meth:`RankReceiver.for_request`).
    """
    #: Set after a digest mismatch: every later stream of this fetch asks for a re-hash.
    rehash = request.rehash

    def stream_once() -> None:
        ask = pb.FetchRequest()
        ask.CopyFrom(request)
        ask.start_index = receiver.next_index
        ask.rehash = rehash
        if receiver.next_index:
            ask.model_fingerprint = receiver.fingerprint
            report.resumed_at.append(receiver.next_index)
        report.streams += 1
        receiver.consume(fetch(ask))

    def attempt() -> None:
        nonlocal rehash
        restarted = False
        while True:  # at most three streams: a recheck and a restart, once each
            try:
                stream_once()
                return
            except DigestMismatchError as exc:
                if rehash or exc.reason:  # a reason: the daemon's own refusal, not our check
                    raise  # the daemon checked what it sent: the copy went bad after that
                rehash = True  # resumes at the tensor that failed; the held ones stay
                report.rechecks += 1
            except AbortedError as exc:
                # The content changed under a resume: ModelChanged, or a bare ABORTED from
                # a daemon that predates reasons. Any other reason is not a restart.
                changed = exc.reason in ("", "ModelChanged")
                if restarted or not receiver.next_index or not changed:
                    raise
                receiver.reset()  # the content changed: never mix versions
                report.restarts += 1
                restarted = True

    try:
        call_with_retry(attempt, policy, stats, progress=lambda: receiver.next_index)
    finally:
        report.received_bytes = receiver.received_bytes
        report.resent_bytes = receiver.discarded_bytes
        report.slice_digest = receiver.kind
    return dict(receiver.tensors)
