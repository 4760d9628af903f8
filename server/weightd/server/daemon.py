"""Building and running the daemon: a factory for tests, ``serve`` for the CLI."""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from weightd.v1 import weightd_pb2_grpc as pb_grpc

from .errors import WeightdError
from .listen import Address, ListenError, parse_address, prepare_unix_socket
from .models import ModelRegistry, load_model
from .service import DEFAULT_CHUNK_BYTES, WeightsService
from .transports.local_server import LocalServer, start_local_server
from .transports.options import LocalConfig, check_config

log = logging.getLogger("weightd")

WEIGHTS_SERVICE = "weightd.v1.Weights"


@dataclass
class ServeConfig:
    """Everything ``weightd serve`` can be told. One object, filled by the CLI."""

    #: (name or None, directory) of each model to serve.
    models: list[tuple[str | None, str]]
    #: A gRPC address: ``unix:///path.sock`` or ``HOST:PORT`` (port 0 picks one).
    listen: str
    #: Allow a TCP address that is not loopback without TLS. Off: weights stay local.
    insecure: bool = False
    #: Worker threads for RPCs; each streaming fetch holds one for its duration.
    max_workers: int = 16
    #: RPCs beyond this many at once are answered RESOURCE_EXHAUSTED, not queued.
    max_concurrent_rpcs: int = 64
    #: Default tensor payload per streamed message.
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: Seconds in-flight RPCs get to finish after SIGTERM.
    grace_seconds: float = 30.0
    extra_options: list[tuple[str, int]] = field(default_factory=list)
    #: Same-host transports: shared-memory packs, pinned staging, CUDA IPC.
    local: LocalConfig = field(default_factory=LocalConfig)


@dataclass
class Daemon:
    server: grpc.Server
    address: Address
    registry: ModelRegistry
    health: health.HealthServicer
    lock: IO[str] | None
    local: LocalServer | None = None

    @property
    def target(self) -> str:
        return self.address.grpc_target

    def set_serving(self, model: str, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set(f"{WEIGHTS_SERVICE}/{model}", status)
        names = self.registry.names()
        overall = bool(names) and all(self.registry.is_ready(n) for n in names)
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if overall
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set("", status)
        self.health.set(WEIGHTS_SERVICE, status)

    def stop(self, grace: float | None) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.local is not None:
            self.local.close()
        self.registry.close()
        if self.lock is not None:
            self.lock.close()


def create_daemon(config: ServeConfig) -> Daemon:
    """Bind and start the gRPC server (health NOT_SERVING); models are loaded separately."""
    address = parse_address(config.listen)
    if not address.is_loopback and not config.insecure:
        raise ListenError(
            f"refusing to serve weights unencrypted on non-loopback address {config.listen}; "
            "use a Unix socket or loopback, or pass --insecure"
        )
    driver = check_config(config.local, address.kind == "unix")
    lock = prepare_unix_socket(address.path) if address.kind == "unix" else None
    registry = ModelRegistry()
    options = [
        ("grpc.so_reuseport", 0),  # a port clash must fail loudly, not share the port
        ("grpc.max_receive_message_length", 1 << 20),  # requests are small
        *config.extra_options,
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=config.max_workers, thread_name_prefix="weightd-rpc"
        ),
        options=options,
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    service = WeightsService(registry, config.chunk_bytes)
    pb_grpc.add_WeightsServicer_to_server(service, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(address.grpc_target)
    except RuntimeError as exc:
        if lock is not None:
            lock.close()
        raise ListenError(f"cannot listen on {config.listen}: {exc}") from None
    if address.kind == "tcp":
        address = Address("tcp", host=address.host, port=port)
    daemon = Daemon(server, address, registry, health_servicer, lock)
    if address.kind == "unix" and config.local.enabled:
        try:
            daemon.local = start_local_server(
                address.path, registry, service.slice_anchor, config.local, driver
            )
        except BaseException:
            if lock is not None:
                lock.close()
            raise
    for status_name in ("", WEIGHTS_SERVICE):
        health_servicer.set(status_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    registry.on_change(daemon.set_serving)
    server.start()
    return daemon


def load_models(daemon: Daemon, models: list[tuple[str | None, str]]) -> None:
    """Verify and publish each model; the first failure propagates (nothing half-published)."""
    for name, directory in models:
        daemon.registry.expect(name or os.path.basename(os.path.realpath(directory)))
    for name, directory in models:
        daemon.registry.publish(load_model(directory, name))


def serve(config: ServeConfig) -> int:
    """Run until SIGTERM/SIGINT; a second signal aborts in-flight RPCs at once."""
    daemon = create_daemon(config)
    log.info("listening on %s", daemon.target)
    try:
        load_models(daemon, config.models)
    except WeightdError:
        daemon.stop(0)
        raise
    log.info("serving %s on %s", ", ".join(daemon.registry.names()), daemon.target)
    stop = threading.Event()
    signals = 0

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("signal %d: draining for up to %.0fs", signum, config.grace_seconds)
            stop.set()
        else:
            log.warning("second signal: aborting in-flight RPCs")
            daemon.server.stop(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop.wait(0.5):
        pass
    daemon.stop(config.grace_seconds)
    log.info("exit")
    return 0
