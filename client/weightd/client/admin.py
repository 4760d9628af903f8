"""``AdminClient``: the operator side of the daemon (reload), over the admin listener.

The admin listener is separate from the worker one: by default ``admin.sock`` in the
daemon's 0700 socket directory, or TCP with mutual TLS and an allowed client identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from weightd.v1 import weightd_pb2 as pb
from weightd.v1 import weightd_pb2_grpc as pb_grpc

from .errors import from_rpc_error


@dataclass(frozen=True)
class ReloadResult:
    model: str
    num_tensors: int
    total_bytes: int
    verify_seconds: float


class AdminClient:
    """``AdminClient("unix:///run/weightd/admin.sock").reload("llama")``."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
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
            raise from_rpc_error(exc) from None
        return ReloadResult(r.model, r.num_tensors, r.total_bytes, r.verify_seconds)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
