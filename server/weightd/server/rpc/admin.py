"""The ``weightd.v1.Admin`` service, served only on the admin listener.

Why a separate listener rather than a check inside one server: a worker's connection
can then never reach an admin method, whatever its credentials, and the admin
socket's permissions (or mutual TLS with an allow-list) are the whole access rule.
The worker listener answers Admin methods with PERMISSION_DENIED (:class:`~.guards.AdminGate`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures
from typing import Final

import grpc

from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

from ..base.errors import InvalidRequest, NoAdapters, WorkerOnly
from ..weights.models import Reloader
from .adapters import Adapters
from .guards import AdminAuthorizer
from .interceptors import Handler, RpcObserver
from .peers import SMALL_LISTENER_CONNECTIONS, SMALL_LISTENER_IDLE_SECONDS, connection_options
from .requests import RequestGuard
from .status import abort, unary
from .versions import MAX_PUBLISH_CHUNK_BYTES, Versions
from .wire import WEIGHTS_SERVICE

log = logging.getLogger("weightd.admin")
#: A deadline further away than this is no deadline (gRPC reports "none" as a huge one).
MAX_RELOAD_WAIT_SECONDS = 365 * 86400.0


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
        # The caller's deadline bounds the reload: past it the load is cancelled and
        # publishes nothing, and the model's reload lock is not held by a call gone.
        # It gives up a moment before the deadline, so the caller hears why.
        left = context.time_remaining()
        timeout = (
            max(0.0, left - min(0.5, left / 10))
            if left is not None and left < MAX_RELOAD_WAIT_SECONDS
            else None
        )
        result = self._reloader.reload(request.model, timeout)
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

    @unary
    def PublishTensors(
        self, request_iterator: Iterator[pb.PublishTensorsChunk], context: grpc.ServicerContext
    ) -> pb.PublishResponse:
        if self._versions is None:
            raise InvalidRequest("this daemon publishes no versions")
        return self._versions.publish_tensors(request_iterator, context)


def create_admin_server(
    reloader: Reloader,
    observer: RpcObserver,
    allowed: frozenset[str] | None,
    adapters: Adapters | None = None,
    bounds: grpc.ServerInterceptor | None = None,
    worker_target: str | None = None,
    versions: Versions | None = None,
) -> grpc.Server:
    """A small gRPC server carrying only the Admin service (ports are added by the caller).

    ``bounds`` (the daemon's :class:`~.streams.StreamBounds`) bounds any server stream.
    A worker RPC sent here is answered :class:`WorkerOnly`, naming ``worker_target``.
    """
    interceptors: list[grpc.ServerInterceptor] = [observer, RequestGuard()]
    if bounds is not None:
        interceptors.append(bounds)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="weightd-admin"),
        interceptors=[*interceptors, AdminAuthorizer(allowed)],
        options=[
            ("grpc.so_reuseport", 0),
            # PublishTensors' chunks (4 MiB of data at most); at most 4 calls at once.
            ("grpc.max_receive_message_length", MAX_PUBLISH_CHUNK_BYTES + (64 << 10)),
            *connection_options(SMALL_LISTENER_CONNECTIONS, SMALL_LISTENER_IDLE_SECONDS),
        ],
        maximum_concurrent_rpcs=4,
    )
    pb_grpc.add_AdminServicer_to_server(AdminService(reloader, adapters, versions), server)
    server.add_generic_rpc_handlers([WorkerMethods(worker_target)])
    return server


#: Services only the worker listener serves: a call to one here is a client aimed at
#: the wrong socket, told so (not gRPC's bare "Method not found!").
WORKER_SERVICES: Final = (WEIGHTS_SERVICE, "grpc.health.v1.Health", "grpc.reflection.")


class WorkerMethods(grpc.GenericRpcHandler):
    """On the admin listener: every worker method answers :class:`WorkerOnly`."""

    def __init__(self, worker_target: str | None) -> None:
        self._worker = worker_target

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        method = handler_call_details.method
        if not method.lstrip("/").startswith(WORKER_SERVICES):
            return None
        where = f"the worker listener at {self._worker}" if self._worker else "the worker listener"
        error = WorkerOnly(
            f"{method} is a worker RPC and this is the daemon's admin listener: connect to "
            f"{where} instead",
            worker=self._worker or "",
        )

        def deny(request: bytes, context: grpc.ServicerContext) -> bytes:
            abort(context, error, method)

        # Unary whatever the method's kind: one request read (every worker method takes
        # one), then the status; a streaming client sees it as its stream's end.
        return grpc.unary_unary_rpc_method_handler(deny, bytes, bytes)
