"""What ``--health-listen`` answers: the daemon's statuses, and whether workers can be served.

The health listener is what Kubernetes probes, so it must tell the truth about the
listener workers use, which it does not share. Design (#15 item 8):

* **Reserved capacity.** Every listener bounds its streams below its thread count
  (:class:`~.streams.StreamBounds`): streams, stalled or not, can never take the last
  threads, so ``Check`` (and every unary call) is always answered. The health
  listener holds at most a few ``Watch`` streams for the same reason.
* **No SERVING while the worker listener cannot take a stream.** While every stream
  slot of the worker listener is taken (a new Fetch would be refused), ``Check`` of
  ``""`` and ``weightd.v1.Weights`` here answers NOT_SERVING: readiness then says what
  a worker would find. Stalled streams free their slot at the idle bound.
* **Liveness apart.** :data:`LIVENESS_SERVICE` answers SERVING whenever this process
  answers at all: a liveness probe must not restart a daemon that is merely busy (a
  fleet starting up fills every slot legitimately), only one that stopped answering.

``Watch`` follows the shared statuses only (a stream cannot be told about capacity
without polling); probes use ``Check``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .streams import StreamBounds
from .wire import WEIGHTS_SERVICE

#: The service name liveness probes ask for (``grpc.health.v1`` Check).
LIVENESS_SERVICE: Final = "weightd.v1.Liveness"
_CAPACITY_SENSITIVE: Final = frozenset({"", WEIGHTS_SERVICE})
_SERVING: Final = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: Final = health_pb2.HealthCheckResponse.NOT_SERVING


class ListenerHealth(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1`` for the health listener, over the daemon's shared servicer."""

    def __init__(self, shared: health.HealthServicer, worker: StreamBounds) -> None:
        self._shared = shared
        self._worker = worker

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service == LIVENESS_SERVICE:
            return health_pb2.HealthCheckResponse(status=_SERVING)
        reply = self._shared.Check(request, context)
        if (
            reply.status == _SERVING
            and request.service in _CAPACITY_SENSITIVE
            and self._worker.full
        ):
            return health_pb2.HealthCheckResponse(status=_NOT_SERVING)
        return reply

    def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        watcher: Iterator[Any] = self._shared.Watch(request, context)
        return watcher
