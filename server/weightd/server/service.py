"""The gRPC servicer: thin. It resolves, plans, streams; errors become statuses in one place."""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from typing import Final, TypeVar

import grpc
from prometheus_client import Counter

from weightd.common.digests import slice_digest
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

from .adapters.rpc import Adapters
from .errors import DataIntegrityError, ModelChanged, NoAdapters, WeightdError, status_for
from .layout import Layout
from .models import LoadedModel, ModelRegistry
from .resume import fingerprint, resume_start
from .runs import RunPattern
from .sharding import RankPlan, TensorSlice, peer_slices

log = logging.getLogger("weightd.service")

DEFAULT_CHUNK_BYTES: Final = 1 << 20  # fastest measured here (PERFORMANCE.md)
MAX_CHUNK_BYTES: Final = 4 << 20
MIN_CHUNK_BYTES: Final = 4 << 10

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _abort(context: grpc.ServicerContext, error: BaseException, method: str) -> None:
    code, detail = status_for(error)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=error)
    context.abort(code, detail)


def unary(
    fn: Callable[[WeightsService, Req, grpc.ServicerContext], Resp],
) -> Callable[[WeightsService, Req, grpc.ServicerContext], Resp]:
    @functools.wraps(fn)
    def wrapper(self: WeightsService, request: Req, context: grpc.ServicerContext) -> Resp:
        try:
            return fn(self, request, context)
        except Exception as exc:
            _abort(context, exc, fn.__name__)
            raise  # unreachable: abort raises

    return wrapper


def layout_of(msg: pb.Layout) -> Layout:
    """The wire layout; pipeline/expert fields left at 0 by older clients mean size 1."""
    return Layout(
        tp_size=msg.tp_size,
        tp_rank=msg.tp_rank,
        pp_size=msg.pp_size or 1,
        pp_rank=msg.pp_rank,
        ep_size=msg.ep_size or 1,
        ep_rank=msg.ep_rank,
        pp_layers=tuple(msg.pp_layers),
    )


class WeightsService(pb_grpc.WeightsServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        adapters: Adapters | None = None,
        resumes: Counter | None = None,
    ) -> None:
        self.registry = registry
        self.chunk_bytes = chunk_bytes
        self.adapters = adapters
        #: ``weightd_fetch_resumes_total``: how often restarts cost clients a resume.
        self.resumes = resumes

    def _adapters(self) -> Adapters:
        if self.adapters is None:
            raise NoAdapters("this daemon serves no adapters")
        return self.adapters

    def FetchAdapter(
        self, request: pb.FetchAdapterRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.FetchResponse]:
        try:
            adapters = self._adapters()
        except Exception as exc:
            _abort(context, exc, "FetchAdapter")
            return
        yield from adapters.fetch(request, context)

    def WatchAdapters(
        self, request: pb.WatchAdaptersRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.AdapterEvent]:
        try:
            adapters = self._adapters()
        except Exception as exc:
            _abort(context, exc, "WatchAdapters")
            return
        yield from adapters.watch(context)

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
            )
        return out

    @unary
    def DescribeModel(
        self, request: pb.DescribeModelRequest, context: grpc.ServicerContext
    ) -> pb.ModelDescription:
        m = self.registry.get(request.model)
        ckpt = m.checkpoint
        out = pb.ModelDescription(
            name=ckpt.name,
            architecture=ckpt.architecture,
            config_json=ckpt.config_json,
            total_bytes=ckpt.total_bytes,
        )
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
    ) -> Iterator[pb.FetchResponse]:
        model: LoadedModel | None = None
        try:
            model = self.registry.get(request.model)
            plan = model.plan_layout(layout_of(request.layout), tuple(request.names))
            chunk = request.max_chunk_bytes or self.chunk_bytes
            chunk = max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, chunk))
            served = fingerprint(model)
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
            yield pb.FetchResponse(model_fingerprint=served)
            yield from self._stream(model, plan, chunk, context, start)
        except Exception as exc:
            if isinstance(exc, DataIntegrityError) and model is not None:
                self.registry.mark_broken(model, str(exc))
            if not isinstance(exc, WeightdError) and not context.is_active():
                return  # the client went away mid-stream; nothing to report to anyone
            _abort(context, exc, "Fetch")

    def _count_resume(self, model: str, outcome: str) -> None:
        if self.resumes is not None:
            self.resumes.labels(model, outcome).inc()

    def _anchor(self, model: LoadedModel, s: TensorSlice, plan: RankPlan) -> str:
        """The verified digest of ``s``: every peer slice of its cut, anchored together."""
        tensor = model.checkpoint.tensors[s.name]
        if s.partition.count == 1:
            return model.anchors.get(tensor, s.partition.key, 0, lambda: [s.pattern])

        def every_peer() -> list[RunPattern]:
            return [p.pattern for p in peer_slices(model.checkpoint, model.rules, s, plan.layout)]

        return model.anchors.get(tensor, s.partition.key, s.partition.index, every_peer)

    def slice_anchor(self, model: LoadedModel, s: TensorSlice, plan: RankPlan) -> str:
        """The anchored digest of ``s``; rank packs are checked against the same anchors."""
        return self._anchor(model, s, plan)

    def _stream(
        self,
        model: LoadedModel,
        plan: RankPlan,
        chunk: int,
        context: grpc.ServicerContext,
        start: int = 0,
    ) -> Iterator[pb.FetchResponse]:
        pending: list[pb.TensorChunk] = []
        pending_bytes = 0
        for index, s in enumerate(plan.slices):
            if index < start:
                continue  # a resume: the client holds these already
            if not context.is_active():
                return
            anchored = self._anchor(model, s, plan)
            header = pb.SliceHeader(
                name=s.name,
                dtype=s.dtype,
                shape=s.shape,
                nbytes=s.nbytes,
                split_dim=s.split_dim,
                replicated=s.replicated,
            )
            hasher = hashlib.sha256()
            offset = 0
            pieces: Iterator[bytes] = model.store.iter_pattern(s.shard, s.pattern, chunk)
            if s.nbytes == 0:
                pieces = iter([b""])
            for data in pieces:
                hasher.update(data)
                piece = pb.TensorChunk(index=index, offset=offset, data=data)
                if offset == 0:
                    piece.header.CopyFrom(header)
                offset += len(data)
                if offset == s.nbytes:
                    actual = slice_digest(hasher)
                    if actual != anchored:
                        raise DataIntegrityError(
                            f"tensor {s.name!r} in shard {s.shard}: slice bytes read now hash to "
                            f"{actual}, the verified slice to {anchored}"
                        )
                    piece.digest = anchored
                if pending and pending_bytes + len(data) > chunk:
                    yield pb.FetchResponse(chunks=pending)
                    pending, pending_bytes = [], 0
                pending.append(piece)
                pending_bytes += len(data)
        yield pb.FetchResponse(
            chunks=pending,
            done=pb.FetchDone(num_tensors=len(plan.slices), total_bytes=plan.nbytes),
        )
