"""Building and running the daemon: a factory for tests, ``serve`` for the CLI."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from ..base.cleanup import on_error
from ..base.errors import ListenError
from ..config import ServeConfig, build
from ..plan.rules import RuleTable
from ..plan.rules_file import load_rules_file
from ..registry.filewatch import ShardWatcher
from ..registry.loading import Reloader, load_independently, load_source, publish_source
from ..registry.models import LoadedModel, ModelRegistry
from ..rpc.adapters import Adapters
from ..rpc.guards import AdminGate
from ..rpc.interceptors import InflightTracker, RpcObserver
from ..rpc.peers import connection_options
from ..rpc.requests import RequestGuard
from ..rpc.streams import StreamBounds, StreamWatchdog
from ..rpc.versions import Versions
from ..rpc.weights import WeightsService, add_weights_service
from ..rpc.wire import WEIGHTS_SERVICE
from ..sources.resolver import SourceResolver
from ..telemetry import logs
from ..telemetry.metrics import Metrics, MetricsServer, serve_metrics
from ..transports.local_server import LocalObserver, LocalServer, start_local_server
from ..transports.local_service import PackService
from ..transports.options import check_config
from ..transports.prebuild import LayoutPrebuilder
from ..transports.publish_socket import PublishSocket, start_publish_socket
from ..trust.verify import VerifyOptions
from . import lifecycle, listeners
from .addresses import Address, parse_address, prepare_unix_socket, settle_address
from .collectors import (
    PinnedMemoryCollector,
    PinnedState,
    ShmPackCollector,
    ShmPackState,
    adapter_metrics,
)
from .domain import Domain, build_domain, expect_models
from .prebuilding import prepare_at_start, register_host_memory
from .security import (
    TlsFiles,
    TlsMaterial,
    check_admin_listener,
    check_worker_listener,
    read_tls,
)
from .sockets import SocketLock

log = logging.getLogger("weightd")


@dataclass
class Daemon:
    server: grpc.Server
    address: Address
    registry: ModelRegistry
    health: health.HealthServicer
    lock: SocketLock | None
    tracker: InflightTracker = field(default_factory=InflightTracker)
    metrics: Metrics | None = None
    metrics_server: MetricsServer | None = None
    admin_server: grpc.Server | None = None
    admin_address: Address | None = None
    health_server: grpc.Server | None = None
    health_address: Address | None = None
    #: Reloads a served model atomically (SIGHUP, and the admin Reload RPC).
    reloader: Reloader | None = None
    watchdog: StreamWatchdog | None = None
    locks: list[SocketLock] = field(default_factory=list)

    @property
    def grpc_servers(self) -> list[grpc.Server]:
        extra = [self.admin_server, self.health_server]
        return [self.server, *(s for s in extra if s is not None)]

    #: LoRA adapters: registry, roots, and the RPCs' shared state.
    adapters: Adapters | None = None

    #: The same-host side socket (shared-memory packs, CUDA IPC), on Unix listeners.
    local: LocalServer | None = None

    #: Notices changed shard files, re-verifies and restores (``--watch-interval``).
    watcher: ShardWatcher | None = None

    #: Brings ``s3://`` models and adapters into the local cache.
    resolver: SourceResolver | None = None

    #: The side socket's packs (on Unix listeners), built before any listener binds.
    packs: PackService | None = None
    #: Builds and holds each model's declared layouts' packs at load (on Unix listeners).
    prebuilder: LayoutPrebuilder | None = None
    #: Where the daemon's metrics are registered (None: no metrics).
    metrics_registry: CollectorRegistry | None = None
    #: Model versions: holds, the watch stream, Publish (``daemon/versioning.py``).
    versions: Versions | None = None
    #: The admin side socket (``<admin socket>.local``): a trainer's publish from memory.
    publishing: PublishSocket | None = None

    @property
    def target(self) -> str:
        return self.address.grpc_target

    def log_listening(self) -> None:
        logs.event("listening", listener="worker", address=self.target)
        if self.admin_address is not None:
            logs.event("listening", listener="admin", address=self.admin_address.grpc_target)
        if self.health_address is not None:
            logs.event("listening", listener="health", address=self.health_address.grpc_target)
        if self.metrics_server is not None:
            logs.event("listening", listener="metrics", address=self.metrics_server.url)

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
        if self.adapters is not None:
            self.adapters.close()  # watch streams end now, not at the end of the grace
        if self.versions is not None:
            self.versions.close()
        for event in [s.stop(grace) for s in self.grpc_servers]:
            event.wait()
        self.close()

    def close(self) -> None:
        """Release everything but the (already stopped) gRPC servers."""
        if self.watcher is not None:
            self.watcher.close()  # first: it reads the stores the registry closes
        if self.adapters is not None:
            self.adapters.close()
        if self.prebuilder is not None:
            self.prebuilder.close()
        if self.versions is not None:
            self.versions.close()
        if self.publishing is not None:
            self.publishing.close()
        if self.local is not None:
            self.local.close()  # and its packs
        elif self.packs is not None:
            self.packs.close()  # the side socket never started
        if self.watchdog is not None:
            self.watchdog.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.resolver is not None:
            self.resolver.close()  # downloads still running end at once
        self.registry.close()
        for lock in [self.lock, *self.locks]:
            if lock is not None:
                lock.close()


def _register_local_collectors(registry: CollectorRegistry, local: LocalServer) -> None:
    """Shared-memory pack and pinned-memory series, read from the side socket on scrape."""
    packs = local.service

    def shm_states() -> list[ShmPackState]:
        return [ShmPackState(m, size, n) for m, (size, n) in sorted(packs.host_usage().items())]

    registry.register(ShmPackCollector(shm_states))
    pinner = packs.pinner
    if pinner is not None:
        registry.register(
            PinnedMemoryCollector(lambda: PinnedState(pinner.pinned_bytes, pinner.budget_bytes))
        )


def _worker_server(
    config: ServeConfig,
    domain: Domain,
    interceptors: list[grpc.ServerInterceptor],
    health_servicer: health.HealthServicer,
) -> grpc.Server:
    """The worker listener's gRPC server (not bound yet): Weights, health, reflection."""
    server_config = config.server
    options = [
        ("grpc.so_reuseport", 0),  # a port clash must fail loudly, not share the port
        ("grpc.max_receive_message_length", 1 << 20),  # requests are small
        *connection_options(server_config.max_connections, server_config.connection_idle_seconds),
        *server_config.extra_options,
    ]
    server = grpc.server(
        listeners.worker_pool(server_config.max_workers),
        options=options,
        maximum_concurrent_rpcs=server_config.max_concurrent_rpcs,
        interceptors=interceptors,
    )
    metrics = domain.metrics
    service = WeightsService(
        domain.weights,
        server_config.chunk_bytes,
        domain.adapters,
        resumes=metrics.fetch_resumes if metrics is not None else None,
        rehash=server_config.fetch_rehash,
        version_rpcs=domain.versions,
        after_fetch=domain.prebuilder.after_read if domain.prebuilder is not None else None,
    )
    add_weights_service(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server_config.reflection:
        listeners.enable_reflection(server)
    return server


def _start_side_socket(
    config: ServeConfig, daemon: Daemon, packs: PackService, group: bool
) -> LocalServer:
    """The same-host side socket beside the worker's Unix socket, with its metrics."""
    metrics, prom, registry = daemon.metrics, daemon.metrics_registry, daemon.registry
    observer = (
        LocalObserver(metrics, listeners.model_resolver(registry)) if metrics is not None else None
    )
    local = start_local_server(
        daemon.address.path, packs, build.local_config(config), group=group, observer=observer
    )
    if prom is not None:
        _register_local_collectors(prom, local)
        if metrics is not None:
            register_host_memory(prom, registry, local, metrics)
    return local


def _start_admin(
    config: ServeConfig,
    daemon: Daemon,
    admin_address: Address,
    allowed: frozenset[str] | None,
    observer: RpcObserver,
    tls: TlsMaterial | None,
) -> None:
    """The admin listener (Reload, Publish, adapters), bound."""
    group = False
    if admin_address.kind == "unix":
        shared = os.path.dirname(admin_address.path) == os.path.dirname(daemon.address.path)
        group = config.socket_group_access and shared
        daemon.locks.append(prepare_unix_socket(admin_address.path, group=group))
    assert daemon.reloader is not None and daemon.adapters is not None
    assert daemon.versions is not None
    daemon.admin_server = listeners.admin_server(
        daemon.reloader,
        observer,
        allowed,
        daemon.adapters,
        daemon.watchdog,
        daemon.address,
        daemon.versions,
    )
    daemon.admin_address = listeners.bind(daemon.admin_server, admin_address, tls, "admin")
    publisher = daemon.versions.publisher
    if admin_address.kind == "unix" and publisher is not None:
        daemon.publishing = start_publish_socket(admin_address.path, publisher)


def _start_health(
    config: ServeConfig, daemon: Daemon, observer: RpcObserver, bounds: StreamBounds
) -> None:
    """The health-only listener (``--health-listen``), bound."""
    assert config.health.listen is not None
    daemon.health_server = listeners.health_server(daemon.health, observer, daemon.watchdog, bounds)
    daemon.health_address = listeners.bind(
        daemon.health_server, parse_address(config.health.listen), None, "health"
    )


def create_daemon(config: ServeConfig, metrics_registry: CollectorRegistry | None = None) -> Daemon:
    """Bind and start every listener (health NOT_SERVING); models are loaded separately.

    ``metrics_registry``: where the daemon registers its metrics (tests pass their own);
    None creates one when ``config.metrics_listen`` is set, else no metrics at all.
    The domain first (:func:`.domain.build_domain`), then one step per listener: the worker's
    gRPC server, its side socket, admin, health, metrics.
    """
    server_config = config.server
    local_config = build.local_config(config)
    address = settle_address(parse_address(config.listen), group=config.socket_group_access)
    tls = read_tls(TlsFiles(config.tls.cert, config.tls.key, config.tls.client_ca))
    warning = check_worker_listener(address, tls=tls is not None, insecure=config.insecure)
    admin_address = listeners.admin_address(config.admin.listen, address)
    if admin_address is not None and config.admin.listen is not None:
        admin_address = settle_address(admin_address)
    allowed = (
        check_admin_listener(admin_address, tls=tls, allowed=frozenset(config.admin.allow))
        if admin_address is not None
        else None
    )
    if (
        tls is not None
        and address.kind == "unix"
        and (admin_address is None or admin_address.kind == "unix")
    ):
        raise ListenError("--tls-cert was given but no TCP listener uses it")
    driver = check_config(local_config, address.kind == "unix")
    if metrics_registry is None and config.metrics.listen is not None:
        metrics_registry = CollectorRegistry()
    local = address.kind == "unix" and local_config.enabled
    domain = build_domain(config, local, driver, metrics_registry)
    registry, metrics = domain.registry, domain.metrics
    tracker = InflightTracker()
    observer = RpcObserver(metrics, tracker, listeners.model_resolver(registry))
    watchdog = (
        StreamWatchdog(
            server_config.max_stream_seconds, idle_seconds=server_config.stream_idle_seconds
        )
        if server_config.max_stream_seconds > 0 or server_config.stream_idle_seconds > 0
        else None
    )
    bounds = StreamBounds(watchdog, server_config.max_workers, "worker")
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    interceptors = [observer, RequestGuard(), AdminGate(admin_address), bounds]
    server = _worker_server(config, domain, interceptors, health_servicer)  # bound below
    daemon = Daemon(
        server,
        address,
        registry,
        health_servicer,
        None,
        tracker,
        metrics,
        watchdog=watchdog,
        metrics_registry=metrics_registry,
        # What the listeners serve, built before any of them (see domain.py):
        adapters=domain.adapters,
        resolver=domain.resolver,
        versions=domain.versions,
        reloader=domain.reloader,
        packs=domain.packs,
        prebuilder=domain.prebuilder,
    )
    with on_error(daemon.close, "the half-built daemon"):
        group = config.socket_group_access
        if address.kind == "unix":
            daemon.lock = prepare_unix_socket(address.path, group=group)
        if config.watch_interval > 0:
            daemon.watcher = ShardWatcher(
                registry, domain.reloader, config.watch_interval, metrics_registry
            )
        daemon.address = listeners.bind(server, address, tls, "worker", group=group)
        if domain.packs is not None:
            daemon.local = _start_side_socket(config, daemon, domain.packs, group)
        if metrics_registry is not None:
            domain.adapter_service.metrics = adapter_metrics(
                metrics_registry, domain.adapter_service, domain.packs
            )
        if warning:
            log.warning("%s", warning)
        if admin_address is not None:
            _start_admin(config, daemon, admin_address, allowed, observer, tls)
        if config.health.listen is not None:
            _start_health(config, daemon, observer, bounds)
        if config.metrics.listen is not None:
            assert metrics_registry is not None
            host, port = listeners.host_port(config.metrics.listen)
            daemon.metrics_server = serve_metrics(metrics_registry, host, port)
    for status_name in ("", WEIGHTS_SERVICE):
        health_servicer.set(status_name, health_pb2.HealthCheckResponse.NOT_SERVING)
    registry.on_change(daemon.set_serving)
    if daemon.watcher is not None:
        daemon.watcher.start()
    for s in daemon.grpc_servers:
        s.start()
    daemon.log_listening()
    return daemon


def load_models(
    daemon: Daemon,
    models: list[tuple[str | None, str]],
    tables: Sequence[RuleTable] = (),
    options: VerifyOptions | None = None,
) -> None:
    """Verify and publish each model (an ``s3://`` one downloaded into the cache first, or
    found there warm), each on its own thread: a model serves as soon as it verifies,
    whatever the others do. A model that fails is ``failed`` (the others serve; a reload
    retries it); only when every model failed does the first failure propagate (there
    is nothing to serve)."""
    named = expect_models(daemon.registry, daemon.metrics, models)
    if daemon.reloader is not None:
        daemon.reloader.tables = tuple(tables)
    cancel = threading.Event()  # set by a signal during start-up (load_independently)
    options = dataclasses.replace(options or VerifyOptions(), cancel=cancel)

    def load(name: str, source: str) -> LoadedModel:
        model = load_source(source, name, daemon.metrics, tables, options, daemon.resolver, cancel)[
            0
        ]
        prepare_at_start(daemon.prebuilder, model)  # declared layouts' packs, before SERVING
        return model

    def publish(model: LoadedModel) -> None:
        publish_source(daemon.registry, model, daemon.resolver)

    def wait(thread: threading.Thread) -> None:
        while thread.is_alive():  # short waits: a signal's handler runs between them
            thread.join(0.2)

    failures = load_independently(daemon.registry, named, load, publish, wait, cancel)
    if failures and len(failures) == len(named):
        raise failures[0][1]


def serve(config: ServeConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain; a second signal aborts in-flight RPCs at once.

    Exit status: 0 after a drain, 1 when aborted; 128 + the signal's number (130 for
    Ctrl-C) when a signal stops start-up, so ``weightd serve ... && next`` stops too.
    """
    tables = [load_rules_file(path) for path in config.rules]  # bad file: fail first
    signals = lifecycle.Signals.install()
    logs.event(
        "start",
        pid=os.getpid(),
        version=listeners.version(),
        models=len(config.model),
        listen=config.listen,
    )
    try:
        daemon = create_daemon(config)
        with on_error(lambda: daemon.stop(0), "the daemon after a failed start"):
            models = [(m.name, m.value) for m in config.model]
            load_models(daemon, models, tables, build.verify_options(config))
            signals.started()  # inside the block: a signal just before this still stops cleanly
    except lifecycle.ShutdownRequested as stop:
        status = 128 + stop.signum
        logs.event("exit", status=status, reason=f"signal {stop.signum} during start-up")
        return status
    reloader = daemon.reloader
    if reloader is not None:

        def on_hangup(signum: int, frame: FrameType | None) -> None:
            log.info("SIGHUP: reloading every model (old versions serve until new ones verify)")
            threading.Thread(target=reloader.reload_all, name="weightd-reload", daemon=True).start()

        signal.signal(signal.SIGHUP, on_hangup)
    registry = daemon.registry
    failed = [n for n in registry.names() if registry.state(n)[0] == "failed"]
    serving = [n for n in registry.names() if n not in failed]
    if failed:  # these serve nothing; a reload retries them
        logs.event(
            "serving", models=",".join(serving), target=daemon.target, failed=",".join(failed)
        )
    else:
        logs.event("serving", models=",".join(serving), target=daemon.target)
    signals.wait()
    status = lifecycle.drain(daemon, config.server.grace, signals)
    logs.event("exit", status=status, aborted=signals.aborted)
    return status
