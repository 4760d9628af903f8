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

from ..base.errors import InvalidRequest, NoAdapters
from ..registry.loading import Reloader
from .adapters import Adapters
from .guards import AdminAuthorizer
from .interceptors import RpcObserver
from .requests import RequestGuard
from .status import unary
from .versions import Versions

log = logging.getLogger("weightd.admin")


class AdminService(pb_grpc.AdminServicer):
    def __init__(
        self, reloader: Reloader, adapters: Adapters | None = None, versions: Versions | None = None
    ) -> None:
        self._reloader = reloader
        self._adapters = adapters
        self._versions = versions

    def _a(self) -> Adapters:
        if self._adapters is None:
            raise NoAdapters("this daemon serves no adapters")
        return self._adapters

    @unary
    def LoadAdapter(
        self, request: pb.LoadAdapterRequest, context: grpc.ServicerContext
    ) -> pb.AdapterStatus:
        return self._a().load(request)

    @unary
    def UnloadAdapter(
        self, request: pb.AdapterNameRequest, context: grpc.ServicerContext
    ) -> pb.AdapterStatus:
        return self._a().unload(request)

    @unary
    def ListAdapters(
        self, request: pb.ListAdaptersRequest, context: grpc.ServicerContext
    ) -> pb.ListAdaptersResponse:
        return self._a().list()

    @unary
    def PinAdapter(
        self, request: pb.AdapterNameRequest, context: grpc.ServicerContext
    ) -> pb.AdapterStatus:
        return self._a().pin(request, True)

    @unary
    def UnpinAdapter(
        self, request: pb.AdapterNameRequest, context: grpc.ServicerContext
    ) -> pb.AdapterStatus:
        return self._a().pin(request, False)

    @unary
    def Reload(self, request: pb.ReloadRequest, context: grpc.ServicerContext) -> pb.ReloadResponse:
        result = self._reloader.reload(request.model)
        ckpt = result.model.checkpoint
        return pb.ReloadResponse(
            model=ckpt.name,
            num_tensors=len(ckpt.tensors),
            total_bytes=ckpt.total_bytes,
            verify_seconds=result.seconds,
        )

    @unary
    def Publish(
        self, request: pb.PublishRequest, context: grpc.ServicerContext
    ) -> pb.PublishResponse:
        if self._versions is None:
            raise InvalidRequest("this daemon publishes no versions")
        return self._versions.publish(request)


def create_admin_server(
    reloader: Reloader,
    observer: RpcObserver,
    allowed: frozenset[str] | None,
    adapters: Adapters | None = None,
    bounds: grpc.ServerInterceptor | None = None,
    versions: Versions | None = None,
) -> grpc.Server:
    """A small gRPC server carrying only the Admin service (ports are added by the caller).

    ``bounds`` (the daemon's :class:`~.streams.StreamBounds`) bounds any server stream.
    """
    interceptors: list[grpc.ServerInterceptor] = [observer, RequestGuard()]
    if bounds is not None:
        interceptors.append(bounds)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="weightd-admin"),
        interceptors=[*interceptors, AdminAuthorizer(allowed)],
        options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 10)],
        maximum_concurrent_rpcs=4,
    )
    pb_grpc.add_AdminServicer_to_server(AdminService(reloader, adapters, versions), server)
    return server
