"""Choosing the transport of a fetch, and fetching over the side socket (shm, CUDA IPC)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..base.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PackPendingError,
    UnavailableError,
    WeightdError,
)
from ..base.layout import Layout
from ..base.request import Delivery, Wanted
from ..receive.hashers import available_kinds
from .local import LocalConnection, attach_request, pack_ref
from .localwire import PLACEMENT_CUDA, PLACEMENT_HOST, Grant, encode_acquire
from .selection import FetchInfo, PackRef, TransportFailure, candidates, side_socket_path
from .shm import map_host_pack

if TYPE_CHECKING:
    import torch

log = logging.getLogger("weightd.client")


class NotApplicable(Exception):
    """The transport does not apply here (not a failure): the daemon offers no CUDA IPC,
    or not on this GPU. ``transport="auto"`` moves on quietly, recording the reason."""


def _cuda_check(conn: LocalConnection, device: torch.device) -> str:
    """The UUID to ask for, once the daemon's hello says it can place packs there."""
    if PLACEMENT_CUDA not in conn.hello.placements:
        raise NotApplicable("the daemon offers no CUDA IPC (started without --cuda-ipc)")
    import torch

    from .cuda_ipc import device_uuid

    if not torch.cuda.is_available():
        raise NotApplicable("this process has no CUDA")
    uuid = device_uuid(device)
    if uuid not in conn.hello.gpu_uuids:
        raise NotApplicable(f"the daemon does not place packs on {device} (GPU {uuid})")
    return uuid


def negotiated_fetch(
    target: str,
    grpc_fetch: Callable[[], dict[str, torch.Tensor]],
    wanted: Wanted,
    delivery: Delivery,
    *,
    timeout: float | None,
) -> tuple[dict[str, torch.Tensor], FetchInfo]:
    """Try the candidate transports for ``delivery.transport`` in order (see
    ``selection``); report every failure.

    ``wanted.adapter``: the rank's pack of that LoRA adapter's current version instead
    of the model's weights (``grpc_fetch`` then streams the adapter).
    """
    transport = delivery.transport
    device = delivery.torch_device()
    layout = wanted.layout
    side = side_socket_path(target)
    try:
        order, reason = candidates(
            transport, device.type, side, side is not None and os.path.exists(side)
        )
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None
    except LookupError as exc:
        raise UnavailableError(str(exc), transport=transport) from None
    failures: list[TransportFailure] = []
    for i, name in enumerate(order):
        try:
            if name == "grpc":
                state = grpc_fetch()
                if device.type != "cpu":
                    state = {n: t.to(device) for n, t in state.items()}
                return state, FetchInfo("grpc", transport, reason, tuple(failures), copied=True)
            assert side is not None
            state, ref = fetch_local(side, name, wanted, delivery, timeout=timeout)
            copied = delivery.copy or (name == "shm" and device.type != "cpu")
            return state, FetchInfo(name, transport, reason, tuple(failures), ref, copied)
        except NotApplicable as exc:
            if transport != "auto":
                raise FailedPreconditionError(str(exc), transport=name) from None
            reason = f"{exc}; {reason}"
        except PackPendingError as exc:  # only asked for by "auto": gRPC serves it now
            reason = f"{name}: {exc.detail}, so over gRPC meanwhile; {reason}"
        except WeightdError as exc:
            if transport != "auto" or exc.transport is None or i == len(order) - 1:
                raise
            log.warning(
                "weightd: %s transport failed for %s, falling back to %s: %s",
                name,
                layout.describe(),
                order[i + 1],
                exc,
            )
            failures.append(TransportFailure(name, exc))
    raise AssertionError("unreachable: gRPC is always the last candidate")


def fetch_local(
    path: str,
    transport: str,
    wanted: Wanted,
    delivery: Delivery,
    *,
    timeout: float | None,
) -> tuple[dict[str, torch.Tensor], PackRef]:
    """One worker's tensors (of the model, or of ``wanted.adapter``) through ``transport``,
    "shm" or "cuda_ipc".

    When ``delivery.transport`` is ``"auto"``, a pack still being built raises
    :class:`.errors.PackPendingError` at once instead of waiting for the build (gRPC
    then serves the fetch).
    """
    conn = LocalConnection(path, transport, timeout)
    version = wanted.version
    try:
        cuda = transport == "cuda_ipc"
        request = encode_acquire(
            wanted,
            placement=PLACEMENT_CUDA if cuda else PLACEMENT_HOST,
            gpu_uuid=_cuda_check(conn, delivery.torch_device()) if cuda else "",
            slice_digests=available_kinds(),
            no_wait=delivery.transport == "auto",
        )
        grant, fds = conn.request(request, max_fds=1)
        _check_granted_layout(grant, wanted.layout, transport)
        if version and grant.version != version:
            # An old daemon serving whatever is current: the transport's failure, so
            # ``auto`` goes on to gRPC, whose stream says the same plainly.
            raise UnavailableError(
                f"the daemon granted a pack of model version {grant.version or '(unnamed)'}, "
                f"not {version}",
                transport=transport,
            )
    except BaseException:
        conn.close()
        raise
    return _map(grant, fds, conn, delivery), pack_ref(grant)


def _check_granted_layout(grant: Grant, layout: Layout, transport: str) -> None:
    """Refuse a pack for another layout than the one asked for.

    A daemon from before the side channel planned whole layouts served every pipeline
    stage and expert rank the TP pack; its grant names only the TP fields. One from
    before ``vocab_pad`` cut the vocabulary in equal blocks; its grant has no
    ``vocab_pad``. Such a pack is never handed out: the failure is the transport's, so
    ``auto`` falls back to gRPC (where the stream's first message tells the same).
    """
    if grant.adapter is not None:
        return  # adapter packs are tensor-parallel only (the daemon refuses others)
    granted = grant.layout
    if granted != layout:
        raise UnavailableError(
            f"the daemon granted a pack for {granted.describe()}, not {layout.describe()} "
            "(it predates pipeline/expert layouts or vocab_pad over shared memory)",
            transport=transport,
        )


def attach_local(
    target: str,
    ref: PackRef,
    names: Sequence[str],
    delivery: Delivery,
    *,
    timeout: float | None,
) -> tuple[dict[str, torch.Tensor], FetchInfo]:
    """A new lease on the pack ``ref`` names; refused if the daemon restarted since."""
    path = side_socket_path(target)
    if path is None:
        raise FailedPreconditionError(f"{target} is not a Unix socket: no side channel")
    transport = "cuda_ipc" if ref.placement == "cuda" else "shm"
    conn = LocalConnection(path, transport, timeout)
    try:
        if conn.hello.boot_id != ref.boot_id:
            raise FailedPreconditionError(
                f"pack {ref.pack_id} was granted by daemon boot {ref.boot_id}; the daemon at "
                f"{path} is boot {conn.hello.boot_id} (it restarted since): fetch again"
            )
        grant, fds = conn.request(attach_request(ref, list(names)), max_fds=1)
    except BaseException:
        conn.close()
        raise
    state = _map(grant, fds, conn, delivery)
    copied = delivery.copy or (transport == "shm" and delivery.torch_device().type != "cpu")
    reason = "attached to a granted pack"
    return state, FetchInfo(transport, transport, reason, (), pack_ref(grant), copied)


def _map(
    grant: Grant, fds: list[int], conn: LocalConnection, delivery: Delivery
) -> dict[str, torch.Tensor]:
    if grant.placement == PLACEMENT_CUDA:
        if fds:
            for fd in fds:
                os.close(fd)
            conn.close()
            raise FailedPreconditionError("a CUDA IPC grant came with a descriptor")
        from .cuda_ipc import map_cuda_pack

        return map_cuda_pack(grant, conn, delivery)
    if len(fds) != 1:
        conn.close()
        raise FailedPreconditionError(
            f"a shared-memory grant came with {len(fds)} descriptors, not 1", transport="shm"
        )
    return map_host_pack(grant, fds[0], conn, delivery)
