"""``AdminClient``: the operator side of the daemon (reload, publish), over the admin listener.

The admin listener is separate from the worker one: by default ``admin.sock`` in the
daemon's 0700 socket directory, or TCP with mutual TLS and an allowed client identity.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from weightd.common.sockets import default_admin_path
from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

from ..base.errors import InvalidArgumentError
from .adapter_files import AdapterStatus, status_of
from .addresses import connect_target, from_call, unix_path
from .publishing import SIDE_SUFFIX, chunks_of, memfd_of, publish_fd, raw_tensors


@dataclass(frozen=True)
class ReloadResult:
    model: str
    num_tensors: int
    total_bytes: int
    verify_seconds: float


@dataclass(frozen=True)
class Published:
    """A version :meth:`AdminClient.publish` made current (``VersionInfo`` and timings)."""

    model: str
    version: int
    fingerprint: str
    source: str
    num_tensors: int
    total_bytes: int
    verify_seconds: float
    prepare_seconds: float
    packs_built: int


def _published(r: pb.PublishResponse) -> Published:
    v = r.version
    return Published(
        v.model,
        v.version,
        v.model_fingerprint,
        v.source,
        v.num_tensors,
        v.total_bytes,
        r.verify_seconds,
        r.prepare_seconds,
        r.packs_built,
    )


class AdminClient:
    """``AdminClient("/run/weightd/admin.sock").reload("llama")``.

    ``target`` by the same rule as :class:`~weightd.client.WeightClient`'s; None: the
    admin socket beside the default worker socket. Aimed at the worker socket, every
    call is :class:`~weightd.client.base.errors.AdminOnly`, naming the admin listener.
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        target = connect_target(target if target is not None else default_admin_path())
        if credentials is None:
            self._channel = grpc.insecure_channel(target)
        else:
            self._channel = grpc.secure_channel(target, credentials)
        self._stub = pb_grpc.AdminStub(self._channel)
        self.target = target
        self.timeout = timeout

    def reload(self, model: str | None = None) -> ReloadResult:
        """Re-verify ``model`` from disk and swap it in; on failure the old one keeps serving."""
        try:
            r = self._stub.Reload(pb.ReloadRequest(model=model or ""), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_call(exc, self.target) from None
        return ReloadResult(r.model, r.num_tensors, r.total_bytes, r.verify_seconds)

    def publish(
        self, source: str, *, model: str | None = None, manifest: str | None = None
    ) -> Published:
        """Serve the checkpoint at ``source`` (an absolute directory or ``s3://`` prefix) as
        ``model``'s next version: verified (against ``manifest`` if given), the packs of
        the layouts in use built, then announced READY on ``WatchVersions``. On failure
        nothing changes and the daemon's reason is raised."""
        request = pb.PublishRequest(model=model or "", source=source, manifest=manifest or "")
        return _published(self._call(self._stub.Publish, request))

    def publish_tensors(
        self,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        model: str | None = None,
        transport: str = "auto",
    ) -> Published:
        """Publish a trainer's tensors (Hugging Face names → torch tensors, or
        :class:`~.publishing.RawTensor`) as ``model``'s next version, with no checkpoint
        on disk; returns the new version (``.version``).

        ``transport``: ``"shm"`` hands a sealed memfd to the admin side socket (the
        daemon's host, a Unix admin socket); ``"grpc"`` streams the bytes over
        ``PublishTensors`` (another host, or a TCP admin listener); ``"auto"`` takes shm
        where the admin side socket exists. The daemon refuses tensors whose names,
        shapes or dtypes differ from the serving version's
        (:class:`~weightd.client.base.errors.InvalidArgumentError` naming the tensor,
        what it got and what was expected); the serving version keeps serving.
        """
        if transport not in ("auto", "shm", "grpc"):
            raise InvalidArgumentError(f"transport {transport!r} is not auto, shm or grpc")
        raws = raw_tensors(tensors)
        path = unix_path(self.target)
        side = path + SIDE_SUFFIX if path is not None else None
        if transport == "shm" and side is None:
            raise InvalidArgumentError(
                f"transport shm needs a Unix admin socket; {self.target} is not one"
            )
        if transport == "shm" or (transport == "auto" and side and os.path.exists(side)):
            assert side is not None
            fd, size = memfd_of(raws)
            try:
                r = publish_fd(side, fd, size, model or "", self.timeout)
            finally:
                os.close(fd)
        else:
            try:
                r = self._stub.PublishTensors(chunks_of(raws, model or ""), timeout=self.timeout)
            except grpc.RpcError as exc:
                raise from_call(exc, self.target) from None
        return _published(r)

    def load_adapter(
        self,
        name: str,
        source_dir: str,
        *,
        model: str | None = None,
        expected_digest: str | None = None,
    ) -> AdapterStatus:
        """Load (or atomically replace) adapter ``name`` from a directory under an adapter root."""
        request = pb.LoadAdapterRequest(
            name=name,
            source_dir=source_dir,
            expected_digest=expected_digest or "",
            model=model or "",
        )
        return status_of(self._call(self._stub.LoadAdapter, request))

    def unload_adapter(self, name: str) -> AdapterStatus:
        """Unload adapter ``name``. Fetches and mapped packs of it keep their version
        until they end; new fetches get ``NotFoundError``."""
        return status_of(self._call(self._stub.UnloadAdapter, pb.AdapterNameRequest(name=name)))

    def pin_adapter(self, name: str, pinned: bool = True) -> AdapterStatus:
        """Pin adapter ``name`` (never evicted to make room under the adapter budget),
        or with ``pinned=False`` unpin it."""
        method = self._stub.PinAdapter if pinned else self._stub.UnpinAdapter
        return status_of(self._call(method, pb.AdapterNameRequest(name=name)))

    def list_adapters(self) -> list[AdapterStatus]:
        """Every loaded adapter: version, digest, base model, bytes, pinned, leases."""
        r = self._call(self._stub.ListAdapters, pb.ListAdaptersRequest())
        return [status_of(a) for a in r.adapters]

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_call(exc, self.target) from None

    def close(self) -> None:
        """Close the channel (also done by ``with AdminClient(...)``)."""
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
