"""Resuming an interrupted Fetch: where the stream starts, and whether it still may.

A rank's tensor order is deterministic (the plan's order), so a client that kept the
tensors it received completely asks for the rest with ``start_index``. It also names
the fingerprint of the content it received them from: if the daemon now serves other
content under the model's name (reloaded, or restarted on a changed checkpoint), the
resume is refused with ABORTED rather than handing out a rank assembled from two
versions. The decision is pure; the fingerprint is the loaded model's
(:attr:`~weightd.server.registry.models.LoadedModel.fingerprint`).
"""

from __future__ import annotations

from ..base.errors import InvalidRequest, ModelChanged


def resume_start(
    model: str, start_index: int, asked_fingerprint: str, served_fingerprint: str, num_tensors: int
) -> int:
    """The plan position a stream starts at (pure).

    Raises :class:`ModelChanged` when ``asked_fingerprint`` is set and differs from
    what is served, :class:`InvalidRequest` when ``start_index`` is past the rank.
    """
    if asked_fingerprint and asked_fingerprint != served_fingerprint:
        raise ModelChanged(
            f"model {model!r} changed since the interrupted fetch: it was "
            f"{asked_fingerprint[:16]}..., the daemon now serves {served_fingerprint[:16]}...; "
            "fetch again from tensor 0"
        )
    if start_index > num_tensors:
        raise InvalidRequest(
            f"start_index {start_index} is past the rank's {num_tensors} tensors of model {model!r}"
        )
    return start_index
