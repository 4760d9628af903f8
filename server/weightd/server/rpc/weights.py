"""The gRPC servicer: thin. It resolves, plans, streams; errors become statuses in one place."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from prometheus_client import Counter

from weightd.common.digests import slice_kind
from weightd.v1 import weightd_pb2 as pb

from ..base.errors import (
    DataIntegrityError,
    InvalidRequest,
    ModelChanged,
    NoAdapters,
    WeightdError,
)
from ..weights.describe import describe_model
from ..weights.models import LoadedModel
from ..weights.service import WeightService
from ..weights.view import RankView
from .adapters import Adapters
from .resume import resume_start
from .status import abort, unary
from .versions import Versions
from .wire import (
    DEFAULT_CHUNK_BYTES,
    WEIGHTS_SERVICE,
    EncodedResponse,
    chunk_bytes,
    serialize_fetch_response,
    slice_header,
)

log = logging.getLogger("weightd.service")


Req = TypeVar("Req")
Resp = TypeVar("Resp")


class WeightsService:
    """The ``weightd.v1.Weights`` methods; register with :func:`add_weights_service`."""

    def __init__(
        self,
        weights: WeightService,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        adapters: Adapters | None = None,
        resumes: Counter | None = None,
        *,
        rehash: bool = False,
        version_rpcs: Versions | None = None,
        after_fetch: Callable[[LoadedModel], None] | None = None,
    ) -> None:
        #: The domain door both edges call (model at version, plan, rank view, broken).
        self.weights = weights
        #: The version RPCs (WatchVersions, HoldVersion, ReleaseVersion); None: this
        #: daemon serves no versions.
        self.version_rpcs = version_rpcs
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
        self.after_fetch = after_fetch

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

    def _versions(self) -> Versions:
        if self.version_rpcs is None:
            raise InvalidRequest("this daemon serves no model versions")
        return self.version_rpcs

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
        out = pb.ListModelsResponse()
        for entry in self.weights.listing():
            m = entry.model
            if m is None:
                out.models.add(name=entry.name, ready=False, state=entry.state, reason=entry.reason)
                continue
            out.models.add(
                name=entry.name,
                architecture=m.checkpoint.architecture,
                total_bytes=m.checkpoint.total_bytes,
                num_tensors=len(m.checkpoint.tensors),
                ready=entry.ready,
                state=entry.state,
                reason=entry.reason,
                version=m.version,
                trust_root=m.trust_root,
            )
        return out

    @unary
    def DescribeModel(
        self, request: pb.DescribeModelRequest, context: grpc.ServicerContext
    ) -> pb.ModelDescription:
        return describe_model(self.weights, request.model, request.version)

    def Fetch(
        self, request: pb.FetchRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchResponse | EncodedResponse]:
        view: RankView | None = None
        try:
            view = self.weights.rank_view(
                request.model, request.version, request.layout, request.names
            )
            model, plan = view.model, view.plan
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
            yield from self._stream(view, chunk, context, start, kind, rehash)
        except Exception as exc:
            if isinstance(exc, DataIntegrityError) and view is not None:
                self.weights.mark_broken(view.model, exc)
            if not isinstance(exc, WeightdError) and not context.is_active():
                return  # the client went away mid-stream; nothing to report to anyone
            abort(context, exc, "Fetch")
        finally:
            if view is not None and self.after_fetch is not None:
                self.after_fetch(view.model)

    def _count_resume(self, model: str, outcome: str) -> None:
        if self.resumes is not None:
            self.resumes.labels(model, outcome).inc()

    def _stream(
        self,
        view: RankView,
        chunk: int,
        context: grpc.ServicerContext,
        start: int = 0,
        kind: str = "sha256",
        rehash: bool = False,
    ) -> Iterator[EncodedResponse]:
        """The rank's chunks, ``chunk`` payload bytes per message at most, hand-encoded.

        With ``rehash``, each slice's bytes are hashed (``kind``) as they are read, and
        the piece that completes a slice carries its digest only once those bytes were
        found to hash to the verified (anchored) digest (:meth:`RankView.pieces`).
        Without it (the default, unless the request asks) the anchored digest is sent as
        it is: the store still compares each shard's ``fstat`` with the verified one
        after every read, and the client checks every byte against the digest. Why that
        is the default: the re-hash is the daemon's second check of bytes the client
        checks anyway, and on a stream bound by CPU it cost a sizeable share of the
        throughput (measured in the gRPC notebook under ``docs/notes/``). What is lost
        is the daemon noticing by itself bytes changed under an unchanged size and
        mtime; a client whose check fails asks again with ``rehash`` set, so the daemon
        then finds out and marks the model broken (the client's ``resumable.py``). Each
        piece is read from the shard straight into the message that carries it, when
        the message is built just before it is yielded (see :mod:`.wire` for why
        messages are not built with protobuf, and why they are written in place).
        """
        pending = EncodedResponse()
        for piece in view.pieces(chunk, start, kind, rehash, alive=context.is_active):
            index = piece.index
            header = slice_header(piece.slice) if piece.first else None
            if not pending.empty and pending.payload_bytes + piece.size > chunk:
                pending.build()  # reads its pieces, checks their digests, or raises
                yield pending
                pending = EncodedResponse()
            if piece.size:
                pending.add_chunk_into(
                    index, piece.offset, piece.size, piece.fill, header=header, digest=piece.digest
                )
            else:
                piece.fill(memoryview(b""))
                pending.add_chunk(index, piece.offset, b"", header=header, digest=piece.digest)
        if not context.is_active():
            return  # the client went away: the view stopped at a slice's start
        plan = view.plan
        pending.set_done(pb.FetchDone(num_tensors=len(plan.slices), total_bytes=plan.nbytes))
        pending.build()
        yield pending


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
