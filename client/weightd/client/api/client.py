"""``WeightClient``: fetch a rank's verified slices from a weightd daemon.

On the daemon's host, ``transport="auto"`` maps shared rank packs or opens CUDA IPC
handles instead (``local_fetch``, ``shm``, ``cuda_ipc``); this module is the gRPC path.

Copies, end to end, for each byte fetched over gRPC (``transport="grpc"``):

1. daemon: page cache → the hand-encoded message's ``bytes`` itself (``preadv`` into
   it, ``server/weightd/server/rpc/wire.py``; no join of pieces read elsewhere), then
   gRPC's copy into its send buffers;
2. client: gRPC receive buffers → the message's ``bytes`` (gRPC's Python API);
3. client: a view of that message → the final, preallocated tensor (one copy); the
   message is parsed by ``fetchwire.py``, not protobuf, whose ``FromString`` and
   ``chunk.data`` added two more copies of every byte.

Nothing is assembled twice: each tensor is allocated once, at its final shape, when
its header arrives, and every chunk is written straight into place. The SHA-256 of
each slice is computed over the same chunk buffers and checked before ``fetch``
returns; a tensor whose digest does not match is never handed out.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from weightd.common.digests import SLICE_DIGEST_ALGORITHM

from ..base.errors import InvalidArgumentError
from ..base.layout import Layout
from ..base.request import Delivery, DeliveryOptions, Wanted, tp_layout
from ..receive.hashers import available_kinds, preferred_kind
from ..transports.selection import FetchInfo, PackRef
from .addresses import connect_target, from_call, said_plainly

# torch (seconds to import) and the modules that make tensors load on the first call
# that makes tensors: ``list_models`` and ``describe`` (``weightd list``) need none.
# gRPC, its stubs and the wire types load with the first call that uses gRPC: a
# same-host fetch talks only to the side socket (``localwire``) and never imports them
# (importing them costs a fresh worker more than the whole fetch: docs/notes, vLLM load).
if TYPE_CHECKING:
    import grpc
    import torch
    from typing_extensions import Unpack

    from weightd.v1 import weightd_pb2_grpc as pb_grpc

    from ..base.retry import RetryPolicy, RetryStats
    from ..receive.fetchwire import RawFetchStub
    from ..receive.stream import ProgressFn
    from ..transports.resumable import ResumeReport
    from .adapter_files import AdapterFiles, AdapterStatus
    from .adapters import AdapterWatch, AdapterWeights
    from .descriptions import ModelDescription, ModelInfo
    from .versions import VersionHold, VersionWatch

T = TypeVar("T")

#: Largest message the client accepts: the daemon caps tensor payload at 4 MiB per
#: message; the rest is headroom for headers of many small tensors sharing a message.
MAX_MESSAGE_BYTES = 16 << 20


class WeightClient:
    """A connection to one weightd daemon.

    ``target``: the daemon's address by the one rule every weightd command uses
    (:mod:`weightd.common.addresses`): a socket path (``/run/weightd/weightd.sock``,
    ``./my.sock``), ``unix:///PATH``, ``HOST:PORT``, or a gRPC target
    (``dns:///host:7070``); None: the daemon's default socket. No daemon there, a
    peer that is not one, or the admin socket instead of the worker one is one line
    naming the fix (:class:`~weightd.client.base.errors.DaemonUnreachable`,
    :class:`~weightd.client.base.errors.NotWeightd`,
    :class:`~weightd.client.base.errors.WorkerOnly`). ``timeout`` bounds each call in
    seconds. Pass ``credentials`` (``grpc.ssl_channel_credentials(...)``) for TLS.

    ``retry`` (a :class:`~weightd.client.base.retry.RetryPolicy`; None: no retries) retries
    calls refused with RESOURCE_EXHAUSTED or UNAVAILABLE, with exponential backoff and
    jitter, for a bounded time; a gRPC fetch cut short resumes from its last complete
    tensor. What retrying cost is in :attr:`retry_stats` and :attr:`last_resume`.
    ``on_tensor(index, name)`` is called after each tensor a gRPC fetch completed.

    ``slice_digest``: the digest kind gRPC fetches ask the daemon for and check,
    ``"blake3"`` or ``"sha256"``; None: BLAKE3 when the ``blake3`` package can be
    imported (several times cheaper per byte on both sides), else SHA-256. A daemon that
    predates the choice sends SHA-256, which is always accepted.

    ``populate``: a shared-memory fetch returns with every page of the rank already
    mapped in this process (``MADV_POPULATE_READ``) instead of faulting pages in as
    they are first read. None (the default): exactly when the daemon's pack is in huge
    pages, where populating takes a fraction of a millisecond per GiB; a pack in
    4 KiB pages costs the same either way (``weightd.client.transports.shm``), and left lazy, a
    worker that reads only part of a rank pays less.
    """

    #: How the latest fetch was served (also returned by :meth:`fetch_with_info`).
    last_fetch: FetchInfo | None = None

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
        chunk_bytes: int = 0,
        retry: RetryPolicy | None = None,
        on_tensor: ProgressFn | None = None,
        slice_digest: str | None = None,
        populate: bool | None = None,
    ) -> None:
        kind = preferred_kind() if slice_digest is None else slice_digest
        if kind not in available_kinds():
            raise InvalidArgumentError(
                f"slice_digest {kind[:64]!r} cannot be checked here: this client has "
                f"{', '.join(available_kinds())}"
            )
        #: The slice digest kind gRPC fetches ask for.
        self.slice_digest = kind
        self.populate = populate
        opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        if retry is not None:
            # gRPC's own reconnect backoff grows to 2 minutes; a restarted daemon must be
            # found again within the policy's backoff instead.
            reconnect_ms = int(retry.max_backoff * 1000)
            opts += [
                ("grpc.initial_reconnect_backoff_ms", int(retry.initial_backoff * 1000) or 1),
                ("grpc.min_reconnect_backoff_ms", int(retry.initial_backoff * 1000) or 1),
                ("grpc.max_reconnect_backoff_ms", reconnect_ms),
            ]
        opts += options
        self._opts = opts
        self._credentials = credentials
        #: The gRPC channel and its stubs, made by the first call that needs them: a
        #: same-host fetch (``transport="shm"`` / ``"cuda_ipc"``) never opens one, and
        #: making a channel can cost milliseconds (see :meth:`_main`).
        self._grpc: tuple[grpc.Channel, pb_grpc.WeightsStub, RawFetchStub] | None = None
        self._closed = False
        #: Extra connections for ``fetch(..., streams=N)``: stream i > 0 uses the i-th.
        self._stream_channels: list[tuple[grpc.Channel, RawFetchStub]] = []
        self._stream_lock = threading.Lock()
        #: The gRPC target the address given resolved to (``unix:///abs/path``, ...).
        self.target = connect_target(target)
        self.timeout = timeout
        self.chunk_bytes = chunk_bytes
        self.retry = retry
        self.on_tensor = on_tensor
        #: Retries made so far, by code, and the time spent waiting.
        self._retry_stats: RetryStats | None = None
        #: How the latest gRPC fetch went: streams, resumes, bytes sent again.
        self.last_resume: ResumeReport | None = None

    def _main(self) -> tuple[grpc.Channel, pb_grpc.WeightsStub, RawFetchStub]:
        """The main channel and its stubs, made on first use.

        Why lazily: a shared-memory fetch talks only to the side socket, and creating a
        gRPC channel in a fresh process can take milliseconds, a large part of a whole
        shared-memory fetch. After :meth:`close` none is made:
        gRPC calls raise ``ValueError``, as they did on the closed channel.
        """
        with self._stream_lock:
            if self._grpc is None:
                if self._closed:
                    # Not a channel made and closed: stubs on a closed channel crash grpcio.
                    raise ValueError(f"WeightClient for {self.target} is closed")
                channel = self._new_channel(self.target, self._opts)
                from weightd.v1 import weightd_pb2_grpc as pb_grpc

                from ..receive.fetchwire import RawFetchStub

                # Fetch with responses left as wire bytes, parsed without copying.
                self._grpc = (channel, pb_grpc.WeightsStub(channel), RawFetchStub(channel))
            return self._grpc

    @property
    def _stub(self) -> pb_grpc.WeightsStub:
        return self._main()[1]

    @property
    def _fetch_stub(self) -> RawFetchStub:
        return self._main()[2]

    def _new_channel(self, target: str, opts: list[tuple[str, Any]]) -> grpc.Channel:
        import grpc

        if self._credentials is None:
            return grpc.insecure_channel(target, options=opts)
        return grpc.secure_channel(target, self._credentials, options=opts)

    def _stream_stub(self, i: int) -> RawFetchStub:
        """The Fetch stub stream ``i`` of a multi-stream fetch uses (0: the main channel).

        Each further stream gets a channel of its own with a private subchannel pool,
        so it is its own HTTP/2 connection: one connection's streams share one
        transport (and its locks and flow-control window) on both sides.
        """
        if i == 0:
            return self._fetch_stub
        with self._stream_lock:
            if self._closed:
                raise ValueError(f"WeightClient for {self.target} is closed")
            while len(self._stream_channels) < i:
                from ..receive.fetchwire import RawFetchStub

                channel = self._new_channel(
                    self.target, [*self._opts, ("grpc.use_local_subchannel_pool", 1)]
                )
                self._stream_channels.append((channel, RawFetchStub(channel)))
            return self._stream_channels[i - 1][1]

    def _retried(self, fn: Callable[[], T]) -> T:
        if self.retry is None:
            return fn()
        from ..base.retry import call_with_retry

        return call_with_retry(fn, self.retry, self.retry_stats)

    @property
    def retry_stats(self) -> RetryStats:
        """Retries made so far, by code, and the time spent waiting."""
        if self._retry_stats is None:
            from ..base.retry import RetryStats

            self._retry_stats = RetryStats()
        return self._retry_stats

    def close(self) -> None:
        """Close every channel this client opened (also done by ``with WeightClient(...)``).
        Tensors already fetched stay valid; shared-memory leases end with their tensors."""
        with self._stream_lock:
            self._closed = True
            if self._grpc is not None:
                self._grpc[0].close()
            for channel, _ in self._stream_channels:
                channel.close()
            self._stream_channels.clear()

    def __enter__(self) -> WeightClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- metadata --------------------------------------------------------------------

    def fetch_adapter(
        self, name: str, rank: int, world_size: int, **delivery: Unpack[DeliveryOptions]
    ) -> AdapterWeights:
        """Rank ``rank``'s slices of the current version of adapter ``name``.

        Delivery (``transport``, ``device``, ``copy``, ``verify``) as for :meth:`fetch`
        (no ``device``: the CPU, or the current GPU for ``"cuda_ipc"``; an adapter comes
        on one stream); the result names the version and ``.transport``.
        """
        from .adapters import fetch_adapter_via

        if delivery.get("device") is None:  # absent, or None as this call always took
            delivery["device"] = "cuda" if delivery.get("transport") == "cuda_ipc" else "cpu"
        wanted = Wanted(tp_layout(rank, world_size), adapter=name)
        with said_plainly(self.target):
            return fetch_adapter_via(
                self.target,
                self._stub,
                wanted,
                self._delivery(delivery),
                timeout=self.timeout,
                chunk_bytes=self.chunk_bytes,
            )

    def resolve_adapter(
        self, name: str, *, model: str | None = None, load: bool = False
    ) -> AdapterStatus:
        """The current version of adapter ``name``; with ``load``, the daemon first loads
        it from its adapter roots when it is not loaded and its operator allows that
        (``--adapter-autoload``). ``model``: the base model it must apply to."""
        from .adapter_files import resolve_adapter

        return resolve_adapter(self._stub, name, model, load, self.timeout)

    def fetch_adapter_files(
        self, name: str, version: int = 0, *, max_bytes: int | None = None
    ) -> AdapterFiles:
        """Both files of ``version`` (0: the current one) exactly as the daemon verified
        them, checked here against the version's digest."""
        from .adapter_files import MAX_ADAPTER_FILES_BYTES, fetch_adapter_files

        return fetch_adapter_files(
            self._stub,
            name,
            version,
            timeout=self.timeout,
            chunk_bytes=self.chunk_bytes,
            max_bytes=MAX_ADAPTER_FILES_BYTES if max_bytes is None else max_bytes,
        )

    def fetch_adapter_files_into(
        self, name: str, version: int, directory: str, *, max_bytes: int | None = None
    ) -> AdapterStatus:
        """:meth:`fetch_adapter_files`, written into new files (0400) in ``directory`` as
        they arrive; raises (discard ``directory`` then) unless they give the digest."""
        from .adapter_files import MAX_ADAPTER_FILES_BYTES, fetch_adapter_files_into

        return fetch_adapter_files_into(
            self._stub,
            name,
            version,
            directory,
            timeout=self.timeout,
            chunk_bytes=self.chunk_bytes,
            max_bytes=MAX_ADAPTER_FILES_BYTES if max_bytes is None else max_bytes,
        )

    def watch_adapters(self, timeout: float | None = None) -> AdapterWatch:
        """Adapter events: a load for each adapter loaded now, then every change in order."""
        from .adapters import AdapterWatch

        return AdapterWatch(self._stub, timeout)

    def watch_versions(
        self, model: str | None = None, timeout: float | None = None
    ) -> VersionWatch:
        """Version events of ``model`` (None: every model): each current version as
        "ready", then every new version as it becomes ready, and older ones as dropped."""
        from .versions import VersionWatch

        return VersionWatch(self._stub, model or "", timeout)

    def hold_version(
        self, model: str | None = None, version: int = 0, *, holder: str = "", ttl: float = 0
    ) -> VersionHold:
        """Keep ``version`` of ``model`` (0: the current one) in the daemon until the hold
        is released (``with``) or ``ttl`` seconds pass (0: the daemon's default, 600 s);
        ``holder`` names who holds it (an engine id) in the daemon's metrics. Raises
        ``NotFoundError`` for a version the daemon no longer holds."""
        from weightd.v1 import weightd_pb2 as pb

        from .versions import VersionHold

        request = pb.HoldVersionRequest(
            model=model or "", version=version, holder=holder, ttl_seconds=int(ttl)
        )
        reply = self._unary(self._stub.HoldVersion, request)
        return VersionHold(self._stub, reply, self.timeout)

    def _unary(self, method: Callable[..., T], request: object) -> T:
        """One unary call, retried under the policy, with its failure typed."""

        import grpc

        def call() -> T:
            try:
                return method(request, timeout=self.timeout)
            except grpc.RpcError as exc:
                raise from_call(exc, self.target) from None

        return self._retried(call)

    def list_models(self) -> list[ModelInfo]:
        """Every model the daemon serves, with its readiness and state."""

        from weightd.v1 import weightd_pb2 as pb

        from .descriptions import model_info_of

        reply = self._unary(self._stub.ListModels, pb.ListModelsRequest())
        return [model_info_of(m) for m in reply.models]

    def describe(self, model: str | None = None, *, version: int = 0) -> ModelDescription:
        """Every tensor of ``model`` (None: the daemon's only model; at ``version``, 0: the
        current one) with its dtype, full shape, shard and verified digest, and the files
        the daemon verified."""
        from weightd.v1 import weightd_pb2 as pb

        from .descriptions import description_of

        request = pb.DescribeModelRequest(model=model or "", version=version)
        return description_of(self._unary(self._stub.DescribeModel, request))

    # --- weights ---------------------------------------------------------------------

    def fetch(
        self,
        rank: int,
        world_size: int,
        *,
        model: str | None = None,
        names: Iterable[str] | None = None,
        **delivery: Unpack[DeliveryOptions],
    ) -> dict[str, torch.Tensor]:
        """This tensor-parallel rank's slice of every tensor (or of ``names``).

        How the tensors are delivered is :class:`~weightd.client.DeliveryOptions`:
        ``transport`` (``"auto"``: CUDA IPC for a CUDA device on the daemon's host,
        shared memory for a CPU fetch on its host, gRPC otherwise; or ``"grpc"``,
        ``"shm"``, ``"cuda_ipc"`` to insist), ``device`` (default ``"cpu"``), ``copy``
        (shared-memory and CUDA IPC tensors view one copy shared by every process on
        the host; ``copy=True`` returns private tensors instead), ``verify`` (re-hash
        shared packs; gRPC always checks digests) and ``streams`` (over gRPC, split the
        rank's tensors into this many groups of about equal bytes, each fetched on its
        own concurrent stream and connection, see :mod:`.streams`; 1 to 16; same-host
        transports ignore it). How the fetch was served is in :attr:`last_fetch`, or
        use :meth:`fetch_with_info`. Pipeline and expert layouts: :meth:`fetch_layout`.
        Raises a :class:`~weightd.client.WeightdError` subclass; a partial result is
        never returned.
        """
        state, _ = self.fetch_with_info(rank, world_size, model=model, names=names, **delivery)
        return state

    def fetch_with_info(
        self,
        rank: int,
        world_size: int,
        *,
        model: str | None = None,
        names: Iterable[str] | None = None,
        **delivery: Unpack[DeliveryOptions],
    ) -> tuple[dict[str, torch.Tensor], FetchInfo]:
        """:meth:`fetch`, and how it was served (transport, reason, failures, pack)."""
        wanted = Wanted(tp_layout(rank, world_size), model or "", tuple(names or ()))
        return self._fetch_negotiated(wanted, self._delivery(delivery))

    def _delivery(
        self, options: DeliveryOptions, into: Mapping[str, torch.Tensor] | None = None
    ) -> Delivery:
        """The delivery a call's keywords ask for, with this client's ``populate``."""
        return Delivery.of(options, into=into, populate=self.populate)

    def _fetch_negotiated(
        self, wanted: Wanted, delivery: Delivery
    ) -> tuple[dict[str, torch.Tensor], FetchInfo]:
        from ..transports.local_fetch import negotiated_fetch

        wanted.layout.check()  # here too: a negative number cannot even be encoded as uint32
        streams = delivery.streams
        if streams != 1:
            from ..transports.streams import MAX_STREAMS

            if not 1 <= streams <= MAX_STREAMS:
                raise InvalidArgumentError(f"streams {streams} is invalid: need 1..{MAX_STREAMS}")

        def grpc_fetch() -> dict[str, torch.Tensor]:
            if streams > 1:
                return self._fetch_grpc_streams(wanted, delivery)
            return self._fetch_grpc(wanted, into=delivery.into)

        def negotiate() -> tuple[dict[str, torch.Tensor], FetchInfo]:
            return negotiated_fetch(self.target, grpc_fetch, wanted, delivery, timeout=self.timeout)

        # The gRPC path retries (and resumes) by itself; only an explicit same-host
        # transport, which never falls back to gRPC, is retried as a whole.
        local_only = delivery.transport in ("shm", "cuda_ipc")
        with said_plainly(self.target):
            state, info = self._retried(negotiate) if local_only else negotiate()
        self.last_fetch = info
        return state, info

    def fetch_layout(
        self,
        layout: Layout,
        *,
        model: str | None = None,
        names: Iterable[str] | None = None,
        version: int = 0,
        **delivery: Unpack[DeliveryOptions],
    ) -> dict[str, torch.Tensor]:
        """Every tensor the worker at ``layout`` holds (or ``names``), sliced, digest-checked.

        A pipeline stage receives only its layers' tensors (and the embeddings, norm and
        head its position needs); an expert-parallel rank only its experts. Asking by
        name for a tensor another worker holds is ``InvalidArgumentError``. Delivery
        (``transport``, ``device``, ``copy``, ``verify``) as in :meth:`fetch`; ``streams``
        needs a tensor-parallel layout; how it was served is in :attr:`last_fetch`.
        ``version``: that version of the model (``watch_versions``, :meth:`hold_version`;
        0: the current one); a version the daemon no longer holds is ``NotFoundError``,
        and a daemon that predates versions is refused.
        """
        wanted = Wanted(layout, model or "", tuple(names or ()), version)
        state, _ = self._fetch_negotiated(wanted, self._delivery(delivery))
        return state

    def attach(
        self,
        ref: PackRef,
        *,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        copy: bool = False,
        verify: bool = False,
    ) -> tuple[dict[str, torch.Tensor], FetchInfo]:
        """Take a lease of your own on a pack another local process fetched (``info.pack``).

        Refused (FailedPreconditionError) when the daemon restarted since ``ref`` was
        granted: its handle would name memory that no longer exists.
        """
        from ..transports.local_fetch import attach_local

        delivery = self._delivery({"device": device, "copy": copy, "verify": verify})
        state, info = attach_local(
            self.target, ref, list(names or ()), delivery, timeout=self.timeout
        )
        self.last_fetch = info
        return state, info

    def _fetch_grpc_streams(self, wanted: Wanted, delivery: Delivery) -> dict[str, torch.Tensor]:
        """The layout's slices over ``delivery.streams`` concurrent Fetch streams
        (:mod:`.streams`).

        The groups name their tensors, so the rank's tensor list comes from
        DescribeModel: every tensor of the checkpoint, for a tensor-parallel layout.
        """
        layout, streams = wanted.layout, delivery.streams
        if layout.pp_size > 1 or layout.ep_size > 1:
            raise InvalidArgumentError(
                f"streams {streams} needs a tensor-parallel layout; got {layout.describe()}"
            )
        from ..transports.resumable import ResumeReport  # lazily, as everything that makes tensors
        from ..transports.streams import fetch_in_streams, merge_reports, split_by_bytes

        model = wanted.model or None
        described = {t.name: t.nbytes for t in self.describe(model, version=wanted.version).tensors}
        names = list(wanted.names) or list(described)
        groups = split_by_bytes([(n, described.get(n, 0)) for n in names], streams)
        reports = [ResumeReport() for _ in groups]

        def fetch_group(i: int, group: list[str], progress: ProgressFn) -> dict[str, torch.Tensor]:
            return self._fetch_grpc(
                dataclasses.replace(wanted, names=tuple(group)),
                into=delivery.into,
                stub=self._stream_stub(i),
                report=reports[i],
                on_tensor=progress,
            )

        try:
            got = fetch_in_streams(groups, fetch_group, self.on_tensor)
        finally:
            self.last_resume = merge_reports(reports)
        return {n: got[n] for n in names}

    def _fetch_grpc(
        self,
        wanted: Wanted,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        stub: RawFetchStub | None = None,
        report: ResumeReport | None = None,
        on_tensor: ProgressFn | None = None,
    ) -> dict[str, torch.Tensor]:
        """The wanted slices, streamed and digest-checked, on the CPU.

        Raises a :class:`~weightd.client.WeightdError` subclass carrying the daemon's
        status code and detail; a partial result is never returned.
        """
        from weightd.v1 import weightd_pb2 as pb

        from ..receive.stream import RankReceiver
        from ..transports.resumable import ResumeReport, fetch_resumable

        request = pb.FetchRequest(
            model=wanted.model,
            layout=wanted.layout.to_proto(),
            names=list(wanted.names),
            max_chunk_bytes=self.chunk_bytes,
            # SHA-256 is what an empty field means: the request stays as it always was.
            slice_digest="" if self.slice_digest == SLICE_DIGEST_ALGORITHM else self.slice_digest,
            version=wanted.version,
        )
        if report is None:
            report = ResumeReport()
            self.last_resume = report
        calls = stub or self._fetch_stub
        return fetch_resumable(
            functools.partial(calls.Fetch, timeout=self.timeout),
            request,
            RankReceiver.for_request(request, on_tensor or self.on_tensor, into),
            policy=self.retry,
            stats=self.retry_stats,
            report=report,
        )

    def load_into(
        self,
        module: torch.nn.Module,
        /,
        rank: int,
        world_size: int,
        *,
        model: str | None = None,
        strict: bool = True,
        in_place: bool = True,
        **delivery: Unpack[DeliveryOptions],
    ) -> FetchInfo:
        """Fetch this rank's slices and load them into ``module``; how it was served.

        With ``strict``, every parameter and buffer the module has must be fetched,
        except parameters tied to (the very same object as) a fetched one, such as
        ``lm_head.weight`` under ``tie_word_embeddings``; and every fetched tensor
        must exist in the module.

        Over gRPC, ``in_place`` receives each slice straight into the module's own CPU
        parameter when dtype and shape match exactly: no second copy of the rank in
        memory. The price: if the fetch fails, the module may be left partly
        overwritten. Pass ``in_place=False`` to reload a module that must stay intact
        on failure (the rank is then fetched whole first, then copied in). Same-host
        transports map the shared pack and copy from it either way. Delivery
        (``transport``, ``streams``, ...) as in :meth:`fetch`.
        """
        from .loading import apply_fetched

        targets = module.state_dict()  # detached views of its parameters and buffers
        wanted = Wanted(tp_layout(rank, world_size), model or "")
        into = targets if in_place else None
        state, info = self._fetch_negotiated(wanted, self._delivery(delivery, into))
        apply_fetched(module, state, targets, strict=strict, source=self.target)
        return info
