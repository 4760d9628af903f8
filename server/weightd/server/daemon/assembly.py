"""Building and running the daemon: a factory for tests, ``serve`` for the CLI."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from ..adapters.registry import AdapterRegistry
from ..adapters.service import AdapterService
from ..base.cleanup import on_error
from ..base.errors import ListenError
from ..plan.rules import RuleTable
from ..plan.rules_file import load_rules_file
from ..registry.filewatch import DEFAULT_INTERVAL_SECONDS, ShardWatcher
from ..registry.loading import Reloader, load_source
from ..registry.models import ModelRegistry
from ..rpc.adapters import Adapters
from ..rpc.guards import AdminGate
from ..rpc.interceptors import InflightTracker, RpcObserver
from ..rpc.requests import RequestGuard
from ..rpc.streams import DEFAULT_IDLE_SECONDS, StreamBounds, StreamWatchdog
from ..rpc.weights import WeightsService, add_weights_service
from ..rpc.wire import DEFAULT_CHUNK_BYTES, WEIGHTS_SERVICE
from ..sources.location import default_model_name
from ..sources.resolver import SourceOptions, SourceResolver
from ..telemetry import logs
from ..telemetry.metrics import Metrics, MetricsServer, SourceMetrics, serve_metrics
from ..transports.local_server import LocalServer, start_local_server
from ..transports.options import LocalConfig, check_config
from ..trust.verify import VerifyOptions
from . import lifecycle, listeners
from .addresses import Address, parse_address, prepare_unix_socket
from .collectors import (
    GpuMemoryCollector,
    ModelCollector,
    ModelStateCollector,
    PinnedMemoryCollector,
    PinnedState,
    ShmPackCollector,
    ShmPackState,
    adapter_metrics,
)
from .security import TlsFiles, check_admin_listener, check_worker_listener, read_tls

log = logging.getLogger("weightd")


@dataclass
class ServeConfig:
    """Everything ``weightd serve`` can be told. One object, filled by the CLI."""

    #: (name or None, directory or ``s3://bucket/prefix/``) of each model to serve.
    models: list[tuple[str | None, str]]
    #: A gRPC address: ``unix:///path.sock`` or ``HOST:PORT`` (port 0 picks one).
    listen: str
    #: Allow a TCP address that is not loopback without TLS. Off: weights stay local.
    insecure: bool = False
    #: Server streams (Fetch, FetchAdapter, watches) served at once; each holds a worker
    #: thread for its duration. A few more threads stay free for unary calls.
    max_workers: int = 16
    #: RPCs beyond this many at once are answered RESOURCE_EXHAUSTED, not queued.
    max_concurrent_rpcs: int = 64
    #: Default tensor payload per streamed message.
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    #: ``--fetch-rehash``: hash each slice's bytes again as every Fetch sends them and
    #: compare with the anchored digest. Off (the default), only streams whose request
    #: asks are re-hashed (a client asks after its own digest check failed); the others
    #: rely on the held descriptors' ``fstat`` and the client's own check.
    fetch_rehash: bool = False
    #: Seconds in-flight RPCs get to finish after SIGTERM.
    grace_seconds: float = 30.0
    #: Sharding rules files (``--rules``), tried before the built-in tables.
    rules_files: list[str] = field(default_factory=list)
    extra_options: list[tuple[str, int]] = field(default_factory=list)
    #: TLS for TCP listeners: certificate chain and key (PEM); with ``tls_client_ca``,
    #: clients must present a certificate signed by that CA (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    #: Admin listener: ``unix:///path.sock``, ``HOST:PORT`` (mutual TLS + ``admin_allow``
    #: required), ``"none"``; None: ``admin.sock`` next to the worker socket.
    admin_listen: str | None = None
    #: Client certificate identities (CN or SAN) allowed to call admin RPCs over TCP.
    admin_allow: list[str] = field(default_factory=list)
    #: ``HOST:PORT`` of the Prometheus HTTP listener; None: no metrics listener.
    metrics_listen: str | None = None
    #: ``HOST:PORT`` of a plaintext gRPC listener serving only grpc.health.v1 (for
    #: Kubernetes gRPC probes, which cannot speak TLS); None: none.
    health_listen: str | None = None
    #: Serve gRPC server reflection (grpc.reflection.v1alpha) on the worker listener.
    reflection: bool = False
    #: Worker and side sockets 0660 in a 0750 directory (members of the daemon's group may
    #: connect) instead of 0600 in 0700. The admin socket stays 0600.
    socket_group_access: bool = False
    #: Longest any server stream may run, whatever deadline the client set (0: no cap).
    max_stream_seconds: float = 3600.0
    #: A stream whose client has not taken a message for this long is cancelled (0: off).
    stream_idle_seconds: float = DEFAULT_IDLE_SECONDS
    #: Trust sources, hash cache and hashing threads for loading (and reloading) models.
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    #: Same-host transports: shared-memory packs, pinned staging, CUDA IPC.
    local: LocalConfig = field(default_factory=LocalConfig)
    #: Directories LoRA adapters may be loaded from (``--adapter-root``); none: every
    #: LoadAdapter is refused (the other adapter RPCs still answer).
    adapter_roots: list[str] = field(default_factory=list)
    #: Bytes of adapters held at once; unleased, unpinned ones are evicted LRU to fit.
    adapter_budget_bytes: int | None = None
    #: Seconds between two checks of every served shard by the file watcher (0: off).
    watch_seconds: float = DEFAULT_INTERVAL_SECONDS
    #: Remote (``s3://``) models and adapters: endpoint, download engine, cache, trust.
    sources: SourceOptions = field(default_factory=SourceOptions)


@dataclass
class Daemon:
    server: grpc.Server
    address: Address
    registry: ModelRegistry
    health: health.HealthServicer
    lock: IO[str] | None
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
    locks: list[IO[str]] = field(default_factory=list)

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
        for event in [s.stop(grace) for s in self.grpc_servers]:
            event.wait()
        self.close()

    def close(self) -> None:
        """Release everything but the (already stopped) gRPC servers."""
        if self.watcher is not None:
            self.watcher.close()  # first: it reads the stores the registry closes
        if self.adapters is not None:
            self.adapters.close()
        if self.local is not None:
            self.local.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
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


def create_daemon(config: ServeConfig, metrics_registry: CollectorRegistry | None = None) -> Daemon:
    """Bind and start every listener (health NOT_SERVING); models are loaded separately.

    ``metrics_registry``: where the daemon registers its metrics (tests pass their own);
    None creates one when ``config.metrics_listen`` is set, else no metrics at all.
    """
    address = parse_address(config.listen)
    tls = read_tls(TlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca))
    warning = check_worker_listener(address, tls=tls is not None, insecure=config.insecure)
    admin_address = listeners.admin_address(config.admin_listen, address)
    allowed = (
        check_admin_listener(admin_address, tls=tls, allowed=frozenset(config.admin_allow))
        if admin_address is not None
        else None
    )
    if (
        tls is not None
        and address.kind == "unix"
        and (admin_address is None or admin_address.kind == "unix")
    ):
        raise ListenError("--tls-cert was given but no TCP listener uses it")
    driver = check_config(config.local, address.kind == "unix")
    if metrics_registry is None and config.metrics_listen is not None:
        metrics_registry = CollectorRegistry()
    registry = ModelRegistry()
    metrics = None
    if metrics_registry is not None:
        metrics = Metrics.create(metrics_registry, version=listeners.version())
        metrics_registry.register(ModelCollector(registry, metrics.scrape_errors))
        metrics_registry.register(ModelStateCollector(registry))
        metrics_registry.register(GpuMemoryCollector())
    tracker = InflightTracker()
    observer = RpcObserver(metrics, tracker, listeners.model_resolver(registry))
    watchdog = (
        StreamWatchdog(config.max_stream_seconds, idle_seconds=config.stream_idle_seconds)
        if config.max_stream_seconds > 0 or config.stream_idle_seconds > 0
        else None
    )
    bounds = StreamBounds(watchdog, config.max_workers, "worker")
    locks: list[IO[str]] = []
    daemon: Daemon | None = None

    def undo() -> None:
        if daemon is not None:
            daemon.close()
        else:
            for held in locks:
                held.close()

    with on_error(undo, "the half-built daemon"):
        group = config.socket_group_access
        lock = prepare_unix_socket(address.path, group=group) if address.kind == "unix" else None
        options = [
            ("grpc.so_reuseport", 0),  # a port clash must fail loudly, not share the port
            ("grpc.max_receive_message_length", 1 << 20),  # requests are small
            *config.extra_options,
        ]
        server = grpc.server(
            listeners.worker_pool(config.max_workers),
            options=options,
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
            interceptors=[observer, RequestGuard(), AdminGate(), bounds],
        )
        source_metrics = (
            SourceMetrics.create(metrics_registry) if metrics_registry is not None else None
        )
        resolver = SourceResolver(config.sources, config.verify, source_metrics)
        adapter_service = AdapterService(
            registry,
            AdapterRegistry(config.adapter_budget_bytes),
            config.adapter_roots,
            resolver=resolver,
        )
        adapters = Adapters(adapter_service)
        service = WeightsService(
            registry,
            config.chunk_bytes,
            adapters,
            resumes=metrics.fetch_resumes if metrics is not None else None,
            rehash=config.fetch_rehash,
        )
        add_weights_service(service, server)
        health_servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if config.reflection:
            listeners.enable_reflection(server)
        daemon = Daemon(
            server,
            address,
            registry,
            health_servicer,
            lock,
            tracker,
            metrics,
            watchdog=watchdog,
            locks=locks,
            adapters=adapters,
            resolver=resolver,
        )
        daemon.reloader = Reloader(
            registry,
            metrics,
            sources={n or default_model_name(d): d for n, d in config.models},
            options=config.verify,
            resolver=resolver,
        )
        if config.watch_seconds > 0:
            daemon.watcher = ShardWatcher(
                registry, daemon.reloader, config.watch_seconds, metrics_registry
            )
        daemon.address = listeners.bind(server, address, tls, "worker", group=group)
        if address.kind == "unix" and config.local.enabled:
            daemon.local = start_local_server(
                address.path, registry, config.local, driver, adapter_service, group=group
            )
            if metrics_registry is not None:
                _register_local_collectors(metrics_registry, daemon.local)
        if metrics_registry is not None:
            adapter_service.metrics = adapter_metrics(
                metrics_registry, adapter_service, daemon.local
            )
        if warning:
            log.warning("%s", warning)
        if admin_address is not None:
            if admin_address.kind == "unix":
                shared = os.path.dirname(admin_address.path) == os.path.dirname(address.path)
                locks.append(prepare_unix_socket(admin_address.path, group=group and shared))
            daemon.admin_server = listeners.admin_server(
                daemon.reloader, observer, allowed, adapters, watchdog
            )
            daemon.admin_address = listeners.bind(daemon.admin_server, admin_address, tls, "admin")
        if config.health_listen is not None:
            daemon.health_server = listeners.health_server(
                health_servicer, observer, watchdog, bounds
            )
            daemon.health_address = listeners.bind(
                daemon.health_server, parse_address(config.health_listen), None, "health"
            )
        if config.metrics_listen is not None:
            assert metrics_registry is not None
            host, port = listeners.host_port(config.metrics_listen)
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
    found there warm); the first failure propagates (nothing half-published)."""
    named = [(name or default_model_name(d), d) for name, d in models]
    for name, _ in named:
        daemon.registry.expect(name)
        if daemon.metrics is not None:
            daemon.metrics.model_known(name)
    for name, source in named:
        model, _ = load_source(source, name, daemon.metrics, tables, options, daemon.resolver)
        daemon.registry.publish(model)


def serve(config: ServeConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain; a second signal aborts in-flight RPCs at once.

    Exit status: 0 after a drain (or a signal during start-up), 1 when aborted.
    """
    tables = [load_rules_file(path) for path in config.rules_files]  # bad file: fail first
    signals = lifecycle.Signals.install()
    logs.event(
        "start",
        pid=os.getpid(),
        version=listeners.version(),
        models=len(config.models),
        listen=config.listen,
    )
    try:
        daemon = create_daemon(config)
        with on_error(lambda: daemon.stop(0), "the daemon after a failed start"):
            load_models(daemon, config.models, tables, config.verify)
            signals.started()  # inside the block: a signal just before this still stops cleanly
    except lifecycle.ShutdownRequested as stop:
        logs.event("exit", status=0, reason=f"signal {stop.signum} during start-up")
        return 0
    reloader = daemon.reloader
    if reloader is not None:

        def on_hangup(signum: int, frame: FrameType | None) -> None:
            log.info("SIGHUP: reloading every model (old versions serve until new ones verify)")
            threading.Thread(target=reloader.reload_all, name="weightd-reload", daemon=True).start()

        signal.signal(signal.SIGHUP, on_hangup)
    logs.event("serving", models=",".join(daemon.registry.names()), target=daemon.target)
    signals.wait()
    status = lifecycle.drain(daemon, config.grace_seconds, signals)
    logs.event("exit", status=status, aborted=signals.aborted)
    return status
