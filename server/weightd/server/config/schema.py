"""``ServeConfig``: every option of ``weightd serve``, each written once, here.

Each field is a :func:`~.fields.setting`: its default, its kind (how text and TOML
are read), its help and its checks. The command-line flags, the ``--config`` TOML
file, the ``WEIGHTD_*`` environment variables, ``weightd config show`` and the
reference page in the docs are all derived from these declarations (see
:mod:`.fields` for the naming rule), so a default or a help text cannot disagree
between them. Checks that involve several fields live in :meth:`ServeConfig.problems`;
checks that need the file system (does the model directory exist) are the CLI's
pre-flight, run before anything is bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from ..adapters.autoload import check_component, check_digest, check_pattern
from ..plan.declared import DeclaredLayout, parse_declared
from ..registry.holdbounds import HoldBounds
from ..rpc.wire import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES
from ..sources.bounds import StoreBounds
from ..sources.download import DownloadSettings
from ..sources.s3 import S3Settings
from ..transports.options import (
    DEFAULT_CUDA_BUDGET_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REMEMBERED,
    DEFAULT_REQUEST_SECONDS,
    DEFAULT_TTL_SECONDS,
)
from .fields import Section, at_least, at_most, not_negative, positive, setting
from .kinds import ByteSize, Choice, Flag, Integer, Items, Maybe, Parsed, Seconds, Text

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
_S3_DOWNLOAD: Final = DownloadSettings()
_S3: Final = S3Settings()
_BOUNDS: Final = StoreBounds()
_HOLDS: Final = HoldBounds()


@dataclass(frozen=True)
class Named:
    """``[NAME=]VALUE``: a model source or a per-model file. ``str()`` gives it back."""

    name: str | None
    value: str

    def __str__(self) -> str:
        return f"{self.name}={self.value}" if self.name is not None else self.value


def parse_named(text: str) -> Named:
    """``NAME=VALUE`` when NAME is a plain name (no ``/``), else the whole text is VALUE.

    ``s3://b/p=x/`` and ``./a=b`` are values, not names: a name never holds a slash.
    """
    name, sep, value = text.partition("=")
    if sep and name and "/" not in name:
        if not value:
            raise ValueError(f"{text!r}: nothing after {name}=")
        return Named(name, value)
    if not text:
        raise ValueError("empty value")
    return Named(None, text)


def _pinned_digest(text: str) -> Named:
    """``NAME=sha256:<hex>``: an adapter name and the digest it must have."""
    named = parse_named(text)
    if named.name is None:
        raise ValueError(f"{text!r}: NAME=sha256:<hex>")
    check_component(named.name, error=ValueError)
    check_digest(named.value)
    return named


_MODEL: Final = Parsed(parse_named, "[NAME=]DIR or [NAME=]s3://BUCKET/PREFIX/")
_MANIFEST: Final = Parsed(parse_named, "[NAME=]FILE")
_ADAPTER_SIGNATURE: Final = (
    "OpenSSF Model Signing signature an adapter loaded under NAME must match (a local "
    "file or an s3:// object; checked with a trust-key or trust-chain; it then vouches "
    "for the adapter as a pinned digest does); repeatable"
)
_LAYOUT: Final = Parsed(parse_declared, "[MODEL=]tp=N[,pp=N][,pp_layers=A+B][,ep=N][,vocab_pad=N]")


@dataclass
class ServerSection(Section):
    """gRPC server: threads, limits, streams, drain."""

    table = "server"

    chunk_bytes: int = setting(
        DEFAULT_CHUNK_BYTES,
        ByteSize(),
        "tensor bytes per streamed Fetch message",
        check=(at_least(1), at_most(MAX_CHUNK_BYTES)),
    )
    fetch_rehash: bool = setting(
        False,
        Flag(),
        "hash each slice again as every Fetch sends it and compare with the anchored digest; "
        "off: only a Fetch that asks is re-hashed (a client asks after its own digest check "
        "failed), the others rely on the shard descriptors' fstat and the client's own check",
    )
    max_workers: int = setting(
        16,
        Integer(),
        "RPC worker threads: server streams (Fetch, FetchAdapter, watches) served at once",
        check=at_least(1),
    )
    max_concurrent_rpcs: int = setting(
        64, Integer(), "RPCs at once; beyond this, RESOURCE_EXHAUSTED", check=at_least(1)
    )
    grace: float = setting(
        30.0, Seconds(), "seconds in-flight RPCs get to finish after SIGTERM", check=not_negative
    )
    max_stream_seconds: float = setting(
        3600.0,
        Seconds(),
        "end any server stream (Fetch, FetchAdapter, watches) running longer than this, "
        "whatever the client's deadline (0: no cap)",
        check=not_negative,
    )
    stream_idle_seconds: float = setting(
        60.0,
        Seconds(),
        "cancel a server stream whose client has taken no message for this long (0: off)",
        check=not_negative,
    )
    max_connections: int = setting(
        0,
        Integer(),
        "worker connections kept at once, in all (gRPC has no per-peer hook); past it new "
        "ones are closed at once (0: a quarter of the open-file limit, at most 4096)",
        check=not_negative,
    )
    connection_idle_seconds: float = setting(
        300.0,
        Seconds(),
        "close a worker connection with no RPC for this long (clients reconnect by "
        "themselves; 0: never)",
        check=not_negative,
    )
    reflection: bool = setting(False, Flag(), "serve gRPC server reflection")
    #: Extra gRPC server options (tests only): no flag, key or variable.
    extra_options: tuple[tuple[str, int], ...] = ()


@dataclass
class TlsSection(Section):
    """TLS for TCP listeners."""

    table = "tls"
    flag_prefix = "tls-"

    cert: str | None = setting(None, Maybe(Text()), "PEM certificate chain", metavar="FILE")
    key: str | None = setting(
        None, Maybe(Text()), "PEM private key for the certificate", metavar="FILE"
    )
    client_ca: str | None = setting(
        None,
        Maybe(Text()),
        "PEM CA bundle: require client certificates signed by it (mutual TLS)",
        metavar="FILE",
    )


@dataclass
class AdminSection(Section):
    """Admin listener (reload, adapter loads): its own socket, never the workers'."""

    table = "admin"
    flag_prefix = "admin-"

    listen: str | None = setting(
        None,
        Maybe(Text()),
        "admin RPC address: a socket path, unix:///PATH.sock, HOST:PORT (mutual TLS and "
        "admin-allow), or 'none'; unset: admin.sock next to the worker socket",
        metavar="ADDRESS",
    )
    allow: tuple[str, ...] = setting(
        (),
        Items(Text()),
        "client certificate CN/SAN allowed to call admin RPCs over TCP (repeatable)",
        metavar="IDENTITY",
    )


@dataclass
class MetricsSection(Section):
    """Prometheus metrics over HTTP."""

    table = "metrics"
    flag_prefix = "metrics-"

    listen: str | None = setting(
        None,
        Maybe(Text()),
        "serve metrics here (host defaults to 127.0.0.1; port 0 picks one, logged); "
        "unset: no metrics listener",
        metavar="HOST:PORT",
    )


@dataclass
class HealthSection(Section):
    """A plaintext gRPC health listener for probes that cannot speak TLS."""

    table = "health"
    flag_prefix = "health-"

    listen: str | None = setting(
        None,
        Maybe(Text()),
        "plaintext gRPC listener with only grpc.health.v1 (Kubernetes gRPC probes); unset: none",
        metavar="HOST:PORT",
    )


@dataclass
class TrustSection(Section):
    """Trust: manifests, signing keys, the hash cache."""

    table = "trust"

    manifest: tuple[Named, ...] = setting(
        (),
        Items(_MANIFEST),
        "trusted manifest a model must match (NAME= when serving several models; an "
        "s3:// manifest must be signed by a trust-key); repeatable",
        metavar="[NAME=]FILE",
    )
    signature: tuple[Named, ...] = setting(
        (),
        Items(_MANIFEST),
        "OpenSSF Model Signing signature (`model_signing sign`) a model must match, "
        "checked with a trust-key (EC) or trust-chain (NAME= when serving several "
        "models; a local file or an s3:// object); repeatable",
        metavar="[NAME=]FILE",
    )
    trust_key: tuple[str, ...] = setting(
        (),
        Items(Text()),
        "public key (PEM) a manifest (Ed25519; OpenSSH too) or an OMS signature (EC "
        "P-256/384/521) must be signed by (repeatable)",
        metavar="PUBKEY",
    )
    trust_chain: tuple[str, ...] = setting(
        (),
        Items(Text()),
        "CA certificates (PEM) an OMS signature made with `model_signing sign "
        "certificate` must chain to (repeatable)",
        metavar="PEM",
    )
    trust_hf_cache: bool = setting(
        False,
        Flag(),
        "require each model to be a Hugging Face cache snapshot whose blob names match",
    )
    trust_object_store: bool = setting(
        False,
        Flag(),
        "serve s3:// models without a trusted manifest (and s3:// adapters without an "
        "expected digest): whoever can write the bucket then decides what is served",
    )
    reverify: bool = setting(False, Flag(), "hash every shard even if the hash cache has it")
    hash_cache: bool = setting(True, Flag(), "read and write the hash cache (in cache-dir)")
    hash_threads: int | None = setting(
        None, Maybe(Integer()), "shards hashed at once (unset: one per core)", check=at_least(1)
    )


@dataclass
class S3Section(Section):
    """Remote sources: s3:// models and adapters (credentials: the AWS SDK's own chain)."""

    table = "s3"
    flag_prefix = "s3-"

    endpoint: str | None = setting(
        None,
        Maybe(Text()),
        "S3-compatible endpoint (SeaweedFS, MinIO, Ceph RGW); unset: AWS",
        metavar="URL",
    )
    region: str | None = setting(None, Maybe(Text()), "region (unset: the AWS configuration's)")
    concurrency: int = setting(
        _S3_DOWNLOAD.concurrency,
        Integer(),
        "ranged GETs in flight per download",
        check=(at_least(1), at_most(256)),
    )
    part_bytes: int = setting(
        _S3_DOWNLOAD.part_bytes,
        ByteSize(),
        "bytes per ranged GET; a crash costs at most this much per GET in flight again",
        check=(at_least(64 << 10), at_most(5 << 30)),
    )
    max_bytes_per_second: int | None = setting(
        _S3_DOWNLOAD.max_bytes_per_second,
        Maybe(ByteSize()),
        "cap the download rate (all GETs together), to leave the node's network to others",
        check=at_least(1),
    )
    max_attempts: int = setting(
        _S3.max_attempts,
        Integer(),
        "attempts per request, retries with the SDK's backoff included (throttling, "
        "dropped connections)",
        check=at_least(1),
    )
    min_bytes_per_second: int = setting(
        _BOUNDS.min_bytes_per_second,
        ByteSize(),
        "a ranged GET delivering less than this per second (after the grace window) is "
        "ended, naming the object: a store that drips bytes cannot hold a load forever",
        check=at_least(1),
    )
    rate_grace_seconds: float = setting(
        _BOUNDS.rate_grace_seconds,
        Seconds(),
        "seconds a ranged GET may take before its rate is judged (connection, first byte)",
        check=(positive, at_most(3600)),
    )
    request_seconds: float = setting(
        _BOUNDS.request_seconds,
        Seconds(),
        "seconds a listing page or a HEAD may take, headers and body together",
        check=(positive, at_most(3600)),
    )
    list_seconds: float = setting(
        _BOUNDS.list_seconds,
        Seconds(),
        "seconds a whole listing may take, every page together",
        check=(positive, at_most(3600)),
    )


@dataclass
class LocalSection(Section):
    """Same-host transports: shared-memory packs, pinned staging, CUDA IPC."""

    table = "local"

    shm: bool = setting(
        True,
        Flag(),
        "open the side socket <socket>.local (shared-memory packs and CUDA IPC) on a Unix listener",
    )
    shm_budget_bytes: int = setting(
        0,
        ByteSize(),
        "bytes of rank packs kept in shared memory (0: half of physical memory)",
        check=not_negative,
    )
    pack_ttl: float = setting(
        DEFAULT_TTL_SECONDS,
        Seconds(),
        "seconds an unleased pack is kept for the next asker before it is freed",
        check=not_negative,
    )
    pin: bool = setting(False, Flag(), "page-lock packs (needs CUDA)")
    pin_budget_bytes: int = setting(
        0,
        ByteSize(),
        "bytes of packs page-locked at once (0: the shared-memory budget)",
        check=not_negative,
    )
    cuda_ipc: bool = setting(False, Flag(), "place packs on GPUs, hand out CUDA IPC handles")
    cuda_budget_bytes: int = setting(
        DEFAULT_CUDA_BUDGET_BYTES, ByteSize(), "bytes of packs per GPU", check=at_least(1)
    )
    side_max_connections: int = setting(
        DEFAULT_MAX_CONNECTIONS,
        Integer(),
        "side-socket connections (one per lease) beyond which new ones are refused with "
        "RESOURCE_EXHAUSTED",
        check=at_least(1),
    )
    side_max_connections_per_user: int = setting(
        0,
        Integer(),
        "side-socket connections one user other than the daemon's (the peer's uid) may hold "
        "at once, beyond which that user's new ones are refused with RESOURCE_EXHAUSTED (0: "
        "half of side-max-connections), so no member of the daemon's group can take every "
        "lease slot from the daemon's own engines",
        check=not_negative,
    )
    side_request_seconds: float = setting(
        DEFAULT_REQUEST_SECONDS,
        Seconds(),
        "seconds a side-socket client has, from connecting, to send its whole request",
        check=positive,
    )
    remember_layouts: bool = setting(
        True,
        Flag(),
        "remember the layouts workers ask for (in cache-dir) and build their packs at the "
        "next load, like --layout",
    )
    max_remembered_layouts: int = setting(
        DEFAULT_MAX_REMEMBERED,
        Integer(),
        "remembered layouts built at a load or publish besides the declared ones, most "
        "recently asked first (any worker's ask is remembered: declare the layouts your "
        "engines need with --layout, which are always built)",
        check=not_negative,
    )
    forget_layouts_after: float = setting(
        7 * 24 * 3600.0,
        Seconds(),
        "seconds after a remembered layout was last asked for that it is forgotten (no "
        "longer built at a load; 0: never)",
        check=not_negative,
    )
    drop_shard_pages: bool = setting(
        True,
        Flag(),
        "once a model's declared layouts are built, drop its shard files from the page "
        "cache (the packs are the resident copy; gRPC fetches of other layouts re-read)",
    )
    pack_build_threads: int = setting(
        0,
        Integer(),
        "threads that build a layout's packs (0: every core)",
        check=not_negative,
    )
    spare_pack_bytes: int = setting(
        0,
        ByteSize(),
        "bytes of shared memory allocated ahead, while idle, for the next version's packs "
        "(0: none; a host that publishes often sets its layouts' pack bytes: the next "
        "build then only copies and hashes, at the cost of that memory held between "
        "publishes)",
        check=not_negative,
    )


@dataclass
class VersionsSection(Section):
    """Model versions: what engines' holds (HoldVersion) may keep."""

    table = "versions"
    flag_prefix = "versions-"

    max_old: int = setting(
        _HOLDS.max_old,
        Integer(),
        "older versions of a model kept while holds name them, besides the current one; a "
        "publish past it drops the oldest, holds and all (each keeps its checkpoint files "
        "open and its packs in shared memory)",
        check=not_negative,
    )
    max_holds_per_client: int = setting(
        _HOLDS.max_holds_per_client,
        Integer(),
        "holds one client (a TCP peer address, or the Unix socket) may have at once; one "
        "more ends that client's oldest hold",
        check=at_least(1),
    )
    max_holds: int = setting(
        _HOLDS.max_holds,
        Integer(),
        "holds outstanding at once in all; one more ends the oldest hold of the client "
        "holding the most",
        check=at_least(1),
    )
    max_hold_seconds: float = setting(
        _HOLDS.max_hold_seconds,
        Seconds(),
        "the longest TTL a hold may ask for (a holder that dies lets go after it)",
        check=positive,
    )

    def bounds(self) -> HoldBounds:
        return HoldBounds(
            self.max_old, self.max_holds, self.max_holds_per_client, self.max_hold_seconds
        )


@dataclass
class AdapterSection(Section):
    """LoRA adapters."""

    table = "adapters"
    flag_prefix = "adapter-"

    root: tuple[str, ...] = setting(
        (),
        Items(Text()),
        "a directory (or s3:// prefix) LoRA adapters may be loaded from (repeatable); "
        "none: no loads",
        metavar="DIR|s3://BUCKET/PREFIX/",
    )
    budget_bytes: int | None = setting(
        None,
        Maybe(ByteSize()),
        "bytes of adapters held at once; unleased, unpinned ones are evicted LRU (unset: no limit)",
        check=at_least(1),
    )
    autoload: tuple[str, ...] = setting(
        (),
        Items(Parsed(check_pattern, "NAME|PREFIX*|*")),
        "adapters a worker may have loaded from the adapter roots by naming one that is not "
        "loaded (ResolveAdapter; vLLM's weightd resolver): an exact name, PREFIX* or * "
        "(repeatable); none: workers get only what an operator loaded",
        metavar="NAME|PREFIX*|*",
    )
    digest: tuple[Named, ...] = setting(
        (),
        Items(Parsed(_pinned_digest, "NAME=sha256:HEX")),
        "the digest an adapter loaded on a worker's request must have (what LoadAdapter's "
        "expected_digest says for an operator's load); repeatable",
        metavar="NAME=sha256:HEX",
    )
    signature: tuple[Named, ...] = setting(
        (), Items(Parsed(parse_named, "NAME=FILE")), _ADAPTER_SIGNATURE, metavar="NAME=FILE"
    )
    autoload_trust_roots: bool = setting(
        False,
        Flag(),
        "load adapters on a worker's request without a pinned digest: whoever can write the "
        "adapter roots then decides what is served (s3:// roots also need trust-object-store)",
    )

    def digests(self) -> dict[str, str]:
        """Pinned digest per adapter name."""
        return {d.name or "": d.value for d in self.digest}

    def signatures(self) -> dict[str, str]:
        """OMS signature per adapter name."""
        return {d.name or "": d.value for d in self.signature}


@dataclass
class ServeConfig:
    """Everything ``weightd serve`` can be told: one object, filled from defaults, the
    ``--config`` file, ``WEIGHTD_*`` variables and flags, in that order of precedence."""

    model: tuple[Named, ...] = setting(
        (),
        Items(_MODEL),
        "checkpoint directory, or an s3:// prefix holding one, to serve (repeatable; "
        "NAME= names it, else the last path component does); none: the built-in demo",
        metavar="[NAME=]DIR|s3://BUCKET/PREFIX/",
    )
    layout: tuple[DeclaredLayout, ...] = setting(
        (),
        Items(_LAYOUT, separator=";"),
        "a deployment to build shared-memory packs for at load, before SERVING "
        "(repeatable; MODEL= limits it to one model; vLLM asks for tp=N at TP=1 and "
        "tp=N,vocab_pad=64 above)",
        metavar="[MODEL=]tp=N[,pp=N][,pp_layers=A+B][,ep=N][,vocab_pad=N]",
    )
    listen: str = setting(
        "",
        Text(),
        "worker gRPC address: a socket path (./w.sock, /run/x.sock), unix:///PATH or "
        "HOST:PORT; in a shared directory such as /tmp, a private weightd-UID one (empty: the "
        "default socket, shown by 'weightd config show')",
        metavar="ADDRESS",
    )
    insecure: bool = setting(
        False,
        Flag(),
        "allow TCP without TLS (logged loudly; off loopback, weights cross the network in clear)",
    )
    socket_group_access: bool = setting(
        False,
        Flag(),
        "worker and side sockets 0660 in a 0750 directory, so members of the daemon's "
        "group may connect (default: 0600 in 0700, this user only; admin stays 0600)",
    )
    cache_dir: str = setting(
        "",
        Text(),
        "where the demo checkpoint, the hash cache and downloaded s3:// sources live "
        "(empty: $XDG_CACHE_HOME/weightd, else ~/.cache/weightd)",
        metavar="DIR",
    )
    rules: tuple[str, ...] = setting(
        (),
        Items(Text()),
        "sharding rules table (JSON) for an architecture (repeatable; tried before the "
        "built-in tables)",
        metavar="FILE",
    )
    watch_interval: float = setting(
        2.0,
        Seconds(),
        "check every served shard file this often: a changed one is reported, a chmod "
        "re-verified, a good file renamed into place restored (0: off)",
        check=not_negative,
    )
    log_level: str = setting(
        "INFO", Choice(LOG_LEVELS), "lowest level of the lines logged (lifecycle events are INFO)"
    )
    log_json: bool = setting(False, Flag(), "log JSON lines")

    server: ServerSection = field(default_factory=ServerSection)
    tls: TlsSection = field(default_factory=TlsSection)
    admin: AdminSection = field(default_factory=AdminSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    health: HealthSection = field(default_factory=HealthSection)
    trust: TrustSection = field(default_factory=TrustSection)
    s3: S3Section = field(default_factory=S3Section)
    local: LocalSection = field(default_factory=LocalSection)
    versions: VersionsSection = field(default_factory=VersionsSection)
    adapters: AdapterSection = field(default_factory=AdapterSection)

    def get(self, path: str) -> Any:
        """The value at ``section.field`` (or ``field``)."""
        owner: Any = self
        *head, last = path.split(".")
        for part in head:
            owner = getattr(owner, part)
        return getattr(owner, last)

    def set(self, path: str, value: Any) -> None:
        owner: Any = self
        *head, last = path.split(".")
        for part in head:
            owner = getattr(owner, part)
        setattr(owner, last, value)

    def model_names(self, default_name: Any) -> list[str]:
        """Names the models are served under (``default_name(source)`` for unnamed ones)."""
        return [m.name or default_name(m.value) for m in self.model]

    def problems(self, names: list[str]) -> list[tuple[str, str]]:
        """``(path, problem)`` for each rule that involves several settings.

        ``names``: the names the models will be served under, in order.
        """
        out: list[tuple[str, str]] = []
        seen: set[str] = set()
        for name in names:
            if name in seen:
                out.append(("model", f"two models named {name!r}; name them apart: NAME=DIR"))
            seen.add(name)
        manifests: dict[str, str] = {}
        for m in self.trust.manifest:
            key = m.name or ""
            if m.name is not None and m.name not in names:
                out.append(
                    (
                        "trust.manifest",
                        f"{m}: no model named {m.name!r} (serving: {', '.join(names)})",
                    )
                )
            if key in manifests:
                out.append(("trust.manifest", f"two manifests for {m.name or 'the model'}"))
            manifests[key] = m.value
        for d in self.layout:
            if d.model is not None and d.model not in names:
                out.append(
                    ("layout", f"{d}: no model named {d.model!r} (serving: {', '.join(names)})")
                )
        if "" in manifests and len(names) > 1:
            out.append(("trust.manifest", "name the model (NAME=FILE) when serving several models"))
        signatures: dict[str, str] = {}
        for m in self.trust.signature:
            if m.name is not None and m.name not in names:
                out.append(
                    (
                        "trust.signature",
                        f"{m}: no model named {m.name!r} (serving: {', '.join(names)})",
                    )
                )
            if (m.name or "") in signatures:
                out.append(("trust.signature", f"two signatures for {m.name or 'the model'}"))
            signatures[m.name or ""] = m.value
        if "" in signatures and len(names) > 1:
            out.append(
                ("trust.signature", "name the model (NAME=FILE) when serving several models")
            )
        adapter_signed = self.adapters.signatures()
        if "" in adapter_signed:
            out.append(("adapters.signature", "name the adapter: NAME=FILE"))
        if (signatures or adapter_signed) and not (self.trust.trust_key or self.trust.trust_chain):
            out.append(
                (
                    "trust.signature",
                    "needs a trust-key or trust-chain (a signature proves origin only "
                    "against a key or CA you name)",
                )
            )
        if self.trust.trust_key and not manifests and not signatures and not adapter_signed:
            out.append(("trust.trust_key", "needs a manifest or signature (the key signs one)"))
        if self.trust.trust_chain and not signatures and not adapter_signed:
            out.append(("trust.trust_chain", "needs a signature (the CA vouches for its signer)"))
        pinned = [d.name for d in self.adapters.digest]
        if len(set(pinned)) != len(pinned):
            out.append(("adapters.digest", "two digests for one adapter name"))
        if (pinned or self.adapters.autoload_trust_roots) and not self.adapters.autoload:
            out.append(
                ("adapters.autoload", "adapter-digest and adapter-autoload-trust-roots need it")
            )
        if self.adapters.autoload and not self.adapters.root:
            out.append(("adapters.autoload", "needs an adapter-root to load from"))
        if self.tls.key is not None and self.tls.cert is None:
            out.append(("tls.key", "needs tls-cert"))
        if self.tls.cert is not None and self.tls.key is None:
            out.append(("tls.cert", "needs tls-key"))
        return out

    def manifests(self) -> dict[str, str]:
        """Manifest per model name ("" for the one unnamed manifest)."""
        return {m.name or "": m.value for m in self.trust.manifest}

    def signatures(self) -> dict[str, str]:
        """OMS signature per model name ("" for the one unnamed signature)."""
        return {m.name or "": m.value for m in self.trust.signature}


__all__ = [
    "LOG_LEVELS",
    "AdapterSection",
    "AdminSection",
    "HealthSection",
    "LocalSection",
    "MetricsSection",
    "Named",
    "S3Section",
    "ServeConfig",
    "ServerSection",
    "TlsSection",
    "TrustSection",
    "VersionsSection",
    "parse_named",
]
