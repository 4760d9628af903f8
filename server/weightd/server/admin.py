"""The ``weightd.v1.Admin`` service, served only on the admin listener.

Why a separate listener rather than a check inside one server: a worker's connection
can then never reach an admin method, whatever its credentials, and the admin
socket's permissions (or mutual TLS with an allow-list) are the whole access rule.
The worker listener answers Admin methods with PERMISSION_DENIED (:class:`~.guards.AdminGate`).
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc

from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

from .errors import status_for
from .guards import AdminAuthorizer
from .interceptors import RpcObserver
from .loading import Reloader

log = logging.getLogger("weightd.admin")


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, reloader: Reloader) -> None:
        self._reloader = reloader

    def Reload(self, request: pb.ReloadRequest, context: grpc.ServicerContext) -> pb.ReloadResponse:
        try:
            result = self._reloader.reload(request.model)
        except Exception as exc:
            code, detail = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                log.error("Reload failed", exc_info=exc)
            context.abort(code, detail)
        ckpt = result.model.checkpoint
        return pb.ReloadResponse(
            model=ckpt.name,
            num_tensors=len(ckpt.tensors),
            total_bytes=ckpt.total_bytes,
            verify_seconds=result.seconds,
        )


def create_admin_server(
    reloader: Reloader,
    observer: RpcObserver,
    allowed: frozenset[str] | None,
) -> grpc.Server:
    """A small gRPC server carrying only the Admin service (ports are added by the caller)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="weightd-admin"),
        interceptors=[observer, AdminAuthorizer(allowed)],
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 10)],
        maximum_concurrent_rpcs=4,
    )
    pb_grpc.add_AdminServicer_to_server(AdminService(reloader), server)
    return server
