"""The gRPC servicer: thin. It resolves, plans, streams; errors become statuses in one place."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
from prometheus_client import Counter

from weightd.common.digests import Hasher, slice_digest, slice_kind
from weightd.v1 import weightd_pb2 as pb

from ..base.errors import (
    DataIntegrityError,
    InvalidRequest,
    ModelChanged,
    NoAdapters,
    WeightdError,
)
from ..plan.layout import Layout
from ..plan.planner import RankPlan
from ..plan.slices import TensorSlice
from ..registry.identity import host_boot_id, shard_samples
from ..registry.models import LoadedModel, ModelRegistry
from ..store.shards import Piece, pattern_pieces
from ..trust.integrity import slice_hasher
from .adapters import Adapters
from .resume import resume_start
from .status import abort, unary
from .versions import Versions
from .wire import (
    DEFAULT_CHUNK_BYTES,
    WEIGHTS_SERVICE,
    EncodedResponse,
    Fill,
    chunk_bytes,
    serialize_fetch_response,
)

log = logging.getLogger("weightd.service")


Req = TypeVar("Req")
Resp = TypeVar("Resp")


class WeightsService:
    """The ``weightd.v1.Weights`` methods; register with :func:`add_weights_service`."""

    def __init__(
        self,
        registry: ModelRegistry,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        adapters: Adapters | None = None,
        resumes: Counter | None = None,
        *,
        rehash: bool = False,
        versions: Versions | None = None,
    ) -> None:
        self.registry = registry
        #: Model versions (Fetch/DescribeModel ``version``, the version RPCs); None: only
        #: the current version of each model is served.
        self.versions = versions
        #: ``--fetch-rehash``: hash every slice's bytes again as they are sent and compare
        #: with the anchor before sending its digest, for every stream; without it, for
        #: the streams whose request asks (``FetchRequest.rehash``; see :meth:`_stream`).
        self.rehash = rehash
        self.chunk_bytes = chunk_bytes
        self.adapters = adapters
        #: ``weightd_fetch_resumes_total``: how often restarts cost clients a resume.
        self.resumes = resumes
        #: Runs when a Fetch stream of a model ends (how it ended aside): where the
        #: model's packs are its resident copy, the shard pages it read are dropped
        #: again (``transports/prebuild.py``).
        self.after_fetch: Callable[[LoadedModel], None] | None = None

    def _adapters(self) -> Adapters:
        if self.adapters is None:
            raise NoAdapters("this daemon serves no adapters")
        return self.adapters

    def _adapter_stream(
        self,
        context: grpc.ServicerContext,
        method: str,
        run: Callable[[Adapters], Iterator[Resp]],
    ) -> Iterator[Resp]:
        """An adapter stream's messages, or its status when this daemon serves none."""
        try:
            adapters = self._adapters()
        except Exception as exc:
            abort(context, exc, method)
        yield from run(adapters)

    def FetchAdapter(
        self, request: pb.FetchAdapterRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchResponse]:
        return self._adapter_stream(context, "FetchAdapter", lambda a: a.fetch(request, context))

    def WatchAdapters(
        self, request: pb.WatchAdaptersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.AdapterEvent]:
        return self._adapter_stream(context, "WatchAdapters", lambda a: a.watch(context))

    @unary
    def ResolveAdapter(
        self, request: pb.ResolveAdapterRequest, context: grpc.ServicerContext
    ) -> pb.AdapterStatus:
        return self._adapters().resolve(request)

    def FetchAdapterFiles(
        self, request: pb.FetchAdapterFilesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.AdapterFileChunk]:
        return self._adapter_stream(
            context, "FetchAdapterFiles", lambda a: a.fetch_files(request, context)
        )

    def _model(self, name: str, version: int) -> LoadedModel:
        """``name`` at ``version`` (0: current); the current one when there are no versions."""
        if self.versions is None:
            if version:
                raise InvalidRequest("this daemon serves no model versions; ask for version 0")
            return self.registry.get(name)
        return self.versions.versions.resolve(name, version)

    def _versions(self) -> Versions:
        if self.versions is None:
            raise InvalidRequest("this daemon serves no model versions")
        return self.versions

    def WatchVersions(
        self, request: pb.WatchVersionsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.VersionEvent]:
        try:
            versions = self._versions()
        except Exception as exc:
            abort(context, exc, "WatchVersions")
        yield from versions.watch(request, context)

    @unary
    def HoldVersion(
        self, request: pb.HoldVersionRequest, context: grpc.ServicerContext
    ) -> pb.HoldVersionResponse:
        return self._versions().hold(request, context)

    @unary
    def ReleaseVersion(
        self, request: pb.ReleaseVersionRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseVersionResponse:
        return self._versions().release(request)

    @unary
    def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.ServicerContext
    ) -> pb.ListModelsResponse:
        loaded = {m.name: m for m in self.registry.models()}
        out = pb.ListModelsResponse()
        for name in self.registry.names():
            m = loaded.get(name)
            state, reason = self.registry.state(name)
            if m is None:
                out.models.add(name=name, ready=False, state=state, reason=reason)
                continue
            out.models.add(
                name=name,
                architecture=m.checkpoint.architecture,
                total_bytes=m.checkpoint.total_bytes,
                num_tensors=len(m.checkpoint.tensors),
                ready=self.registry.is_ready(name),
                state=state,
                reason=reason,
                version=m.version,
            )
        return out

    @unary
    def DescribeModel(
        self, request: pb.DescribeModelRequest, context: grpc.ServicerContext
    ) -> pb.ModelDescription:
        m = self._model(request.model, request.version)
        ckpt = m.checkpoint
        out = pb.ModelDescription(
            name=ckpt.name,
            architecture=ckpt.architecture,
            config_json=ckpt.config_json,
            total_bytes=ckpt.total_bytes,
            model_fingerprint=m.fingerprint,
            version=m.version,
        )
        # Every file the load read and verified, so a client can prove a local copy
        # (vLLM's model directory) is this checkpoint. A shard's SHA-256 is present
        # when the daemon hashed the whole file (manifest, HF cache); its size always.
        # Each shard also with the identity of the file the daemon holds and a sampled
        # digest of its tensors (registry/identity.py): a fine-tune of the same shapes
        # is told apart without reading the whole checkpoint.
        samples = shard_samples(m)
        out.host_boot_id = host_boot_id()
        for name in sorted(set(ckpt.small_files) | set(ckpt.shards)):
            known = m.file_digests.get(name)
            size = known.size if known is not None else m.store.shard(name).identity.size
            entry = out.files.add(name=name, size=size, sha256=known.sha256 if known else "")
            if name in ckpt.shards:
                held = m.store.shard(name).identity
                entry.device, entry.inode, entry.mtime_ns = held.dev, held.ino, held.mtime_ns
                entry.sample_digest = samples[name]
        for t in ckpt.tensors.values():
            out.tensors.add(
                name=t.name,
                dtype=t.dtype,
                shape=t.shape,
                shard=t.shard,
                nbytes=t.nbytes,
                digest=m.tensor_digests[t.name],
            )
        return out

    def Fetch(
        self, request: pb.FetchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchResponse | EncodedResponse]:
        model: LoadedModel | None = None
        try:
            model = self._model(request.model, request.version)
            plan = model.plan_layout(Layout.of(request.layout), tuple(request.names))
            chunk = chunk_bytes(request.max_chunk_bytes, self.chunk_bytes)
            try:
                kind = slice_kind(request.slice_digest)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
            served = model.fingerprint
            try:
                start = resume_start(
                    model.name,
                    request.start_index,
                    request.model_fingerprint,
                    served,
                    len(plan.slices),
                )
            except ModelChanged:
                self._count_resume(model.name, "refused")
                raise
            if start:
                self._count_resume(model.name, "resumed")
                log.info(
                    "fetch resumed model=%s start_index=%d num_tensors=%d peer=%s",
                    model.name,
                    start,
                    len(plan.slices),
                    context.peer(),
                )
            # The kind is named only to a client that asked: an old client's stream
            # stays byte for byte what it was.
            named = kind if request.slice_digest else ""
            # The padding the vocabulary was cut with, echoed: what tells a client that
            # asked for vocab_pad this daemon honoured it (an old one leaves it 0).
            yield pb.FetchResponse(
                model_fingerprint=served,
                slice_digest=named,
                vocab_pad=plan.layout.vocab_pad,
                version=model.version,
            )
            rehash = self.rehash or request.rehash
            if request.rehash:
                log.info(
                    "fetch asks for a re-hash model=%s start_index=%d peer=%s",
                    model.name,
                    start,
                    context.peer(),
                )
            yield from self._stream(model, plan, chunk, context, start, kind, rehash)
        except Exception as exc:
            if isinstance(exc, DataIntegrityError) and model is not None:
                self.registry.mark_broken(model, str(exc))
            if not isinstance(exc, WeightdError) and not context.is_active():
                return  # the client went away mid-stream; nothing to report to anyone
            abort(context, exc, "Fetch")
        finally:
            if model is not None and self.after_fetch is not None:
                self.after_fetch(model)

    def _count_resume(self, model: str, outcome: str) -> None:
        if self.resumes is not None:
            self.resumes.labels(model, outcome).inc()

    def _stream(
        self,
        model: LoadedModel,
        plan: RankPlan,
        chunk: int,
        context: grpc.ServicerContext,
        start: int = 0,
        kind: str = "sha256",
        rehash: bool = False,
    ) -> Iterator[EncodedResponse]:
        """The rank's chunks, ``chunk`` payload bytes per message at most, hand-encoded.

        With ``rehash``, each slice's bytes are hashed (``kind``) as they are read, and
        the piece that completes a slice carries its digest only once those bytes were
        found to hash to the verified (anchored) digest. Without it (the default, unless
        the request asks) the anchored digest is sent as it is: the store still compares
        each shard's ``fstat`` with the verified one after every read, and the client
        checks every byte against the digest. Why that is the default: the re-hash is
        the daemon's second check of bytes the client checks anyway, and on a stream
        bound by CPU it cost a sizeable share of the throughput (measured in the gRPC notebook
        under ``docs/notes/``). What is
        lost is the daemon noticing by itself bytes changed under an unchanged size and
        mtime; a client whose check fails asks again with ``rehash`` set, so the daemon
        then finds out and marks the model broken (the client's ``resumable.py``). Each piece
        is read from the shard straight into the message that carries it, when the
        message is built just before it is yielded (see :mod:`.wire` for why messages
        are not built with protobuf, and why they are written in place).
        """
        pending = EncodedResponse()
        for index, s in enumerate(plan.slices):
            if index < start:
                continue  # a resume: the client holds these already
            if not context.is_active():
                return
            anchored = model.slice_anchor(s, plan.layout, kind)
            header: pb.SliceHeader | None = pb.SliceHeader(
                name=s.name,
                dtype=s.dtype,
                shape=s.shape,
                nbytes=s.nbytes,
                split_dim=s.split_dim,
                replicated=s.replicated,
            )
            hasher = slice_hasher(kind) if rehash else None
            offset = 0
            pieces: Iterable[Piece] = pattern_pieces(s.pattern, chunk)
            if s.nbytes == 0:
                pieces = (Piece(0),)
            for piece in pieces:
                size = piece.size
                last = offset + size == s.nbytes
                fill = _filler(model, s, piece, hasher, kind, anchored if last else None)
                if not pending.empty and pending.payload_bytes + size > chunk:
                    pending.build()  # reads its pieces, checks their digests, or raises
                    yield pending
                    pending = EncodedResponse()
                digest = anchored if last else ""
                if size:
                    pending.add_chunk_into(index, offset, size, fill, header=header, digest=digest)
                else:
                    fill(memoryview(b""))
                    pending.add_chunk(index, offset, b"", header=header, digest=digest)
                header = None  # the first chunk of a slice only
                offset += size
        pending.set_done(pb.FetchDone(num_tensors=len(plan.slices), total_bytes=plan.nbytes))
        pending.build()
        yield pending


def _filler(
    model: LoadedModel,
    s: TensorSlice,
    piece: Piece,
    hasher: Hasher | None,
    kind: str,
    anchored: str | None,
) -> Fill:
    """What writes one piece of slice ``s`` into its message (see :meth:`WeightsService._stream`).

    It reads the piece from the shard straight into the message (the store checks the
    shard's identity after the read), feeds the slice's running hash, and on the
    slice's last piece (``anchored`` set) compares the digest with the verified one:
    a mismatch raises before the message exists, so those bytes are never sent.
    """

    def fill(view: memoryview) -> None:
        if view.nbytes:
            model.store.read_piece_into(s.shard, s.pattern, piece, view)
        if hasher is not None:
            hasher.update(view)
        if anchored is None:
            return
        actual = anchored if hasher is None else slice_digest(hasher, kind)
        if actual != anchored:
            raise DataIntegrityError(
                f"tensor {s.name!r} in shard {s.shard}: slice bytes read now hash to "
                f"{actual}, the verified slice to {anchored}"
            )

    return fill


def add_weights_service(service: WeightsService, server: grpc.Server) -> None:
    """Register ``service`` for every method of ``weightd.v1.Weights`` on ``server``.

    What the generated ``add_WeightsServicer_to_server`` does, except that Fetch's
    responses go through :func:`.wire.serialize_fetch_response`, which accepts the
    hand-encoded messages :meth:`WeightsService.Fetch` yields (same wire bytes).
    ``tests/unit/rpc/test_wire.py`` checks this table against the proto's methods.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "ListModels": grpc.unary_unary_rpc_method_handler(
            service.ListModels,
            request_deserializer=pb.ListModelsRequest.FromString,
            response_serializer=pb.ListModelsResponse.SerializeToString,
        ),
        "DescribeModel": grpc.unary_unary_rpc_method_handler(
            service.DescribeModel,
            request_deserializer=pb.DescribeModelRequest.FromString,
            response_serializer=pb.ModelDescription.SerializeToString,
        ),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            service.Fetch,
            request_deserializer=pb.FetchRequest.FromString,
            response_serializer=serialize_fetch_response,
        ),
        "FetchAdapter": grpc.unary_stream_rpc_method_handler(
            service.FetchAdapter,
            request_deserializer=pb.FetchAdapterRequest.FromString,
            response_serializer=pb.FetchResponse.SerializeToString,
        ),
        "WatchAdapters": grpc.unary_stream_rpc_method_handler(
            service.WatchAdapters,
            request_deserializer=pb.WatchAdaptersRequest.FromString,
            response_serializer=pb.AdapterEvent.SerializeToString,
        ),
        "ResolveAdapter": grpc.unary_unary_rpc_method_handler(
            service.ResolveAdapter,
            request_deserializer=pb.ResolveAdapterRequest.FromString,
            response_serializer=pb.AdapterStatus.SerializeToString,
        ),
        "FetchAdapterFiles": grpc.unary_stream_rpc_method_handler(
            service.FetchAdapterFiles,
            request_deserializer=pb.FetchAdapterFilesRequest.FromString,
            response_serializer=pb.AdapterFileChunk.SerializeToString,
        ),
        "WatchVersions": grpc.unary_stream_rpc_method_handler(
            service.WatchVersions,
            request_deserializer=pb.WatchVersionsRequest.FromString,
            response_serializer=pb.VersionEvent.SerializeToString,
        ),
        "HoldVersion": grpc.unary_unary_rpc_method_handler(
            service.HoldVersion,
            request_deserializer=pb.HoldVersionRequest.FromString,
            response_serializer=pb.HoldVersionResponse.SerializeToString,
        ),
        "ReleaseVersion": grpc.unary_unary_rpc_method_handler(
            service.ReleaseVersion,
            request_deserializer=pb.ReleaseVersionRequest.FromString,
            response_serializer=pb.ReleaseVersionResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(WEIGHTS_SERVICE, handlers),)
    )
    server.add_registered_method_handlers(WEIGHTS_SERVICE, handlers)
