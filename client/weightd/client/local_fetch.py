"""Fetching over the side socket: shared-memory packs and CUDA IPC, for ``WeightClient``."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

from .cuda_ipc import device_uuid, map_cuda_pack
from .errors import FailedPreconditionError
from .local import LocalConnection, attach_request, pack_ref
from .shm import map_host_pack
from .transports import PackRef


class NotApplicable(Exception):
    """The transport does not apply here (not a failure): the daemon offers no CUDA IPC,
    or not on this GPU. ``transport="auto"`` moves on quietly, recording the reason."""


def _cuda_check(conn: LocalConnection, device: torch.device) -> str:
    """The UUID to ask for, once the daemon's hello says it can place packs there."""
    if lpb.PLACEMENT_CUDA not in conn.hello.placements:
        raise NotApplicable("the daemon offers no CUDA IPC (started without --cuda-ipc)")
    if not torch.cuda.is_available():
        raise NotApplicable("this process has no CUDA")
    uuid = device_uuid(device)
    if uuid not in conn.hello.gpu_uuids:
        raise NotApplicable(f"the daemon does not place packs on {device} (GPU {uuid})")
    return uuid


def fetch_local(
    path: str,
    transport: str,
    *,
    model: str,
    world_size: int,
    rank: int,
    names: Sequence[str],
    device: torch.device,
    copy: bool,
    verify: bool,
    timeout: float | None,
) -> tuple[dict[str, torch.Tensor], PackRef]:
    """One rank's tensors through ``transport`` ("shm" or "cuda_ipc")."""
    conn = LocalConnection(path, transport, timeout)
    try:
        acquire = lpb.AcquirePack(
            model=model,
            layout=pb.Layout(tp_size=world_size, tp_rank=rank),
            names=list(names),
            placement=lpb.PLACEMENT_HOST,
        )
        if transport == "cuda_ipc":
            acquire.placement = lpb.PLACEMENT_CUDA
            acquire.gpu_uuid = _cuda_check(conn, device)
        grant, fds = conn.request(lpb.LocalRequest(acquire=acquire), max_fds=1)
    except BaseException:
        conn.close()
        raise
    return _map(grant, fds, conn, device, copy, verify), pack_ref(grant)


def attach_local(
    path: str,
    ref: PackRef,
    *,
    names: Sequence[str],
    device: torch.device,
    copy: bool,
    verify: bool,
    timeout: float | None,
) -> tuple[dict[str, torch.Tensor], PackRef]:
    """A new lease on the pack ``ref`` names; refused if the daemon restarted since."""
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
    return _map(grant, fds, conn, device, copy, verify), pack_ref(grant)


def _map(
    grant: lpb.PackGrant,
    fds: list[int],
    conn: LocalConnection,
    device: torch.device,
    copy: bool,
    verify: bool,
) -> dict[str, torch.Tensor]:
    if grant.placement == lpb.PLACEMENT_CUDA:
        if fds:
            for fd in fds:
                os.close(fd)
            conn.close()
            raise FailedPreconditionError("a CUDA IPC grant came with a descriptor")
        return map_cuda_pack(grant, conn, device=device, copy=copy, verify=verify)
    if len(fds) != 1:
        conn.close()
        raise FailedPreconditionError(
            f"a shared-memory grant came with {len(fds)} descriptors, not 1", transport="shm"
        )
    return map_host_pack(grant, fds[0], conn, copy=copy, verify=verify, device=device)
