"""A real gRPC server in front of a daemon that forgets a request field: an old daemon.

A daemon from before a wire field ignores it; that is all it does differently with a
new client's request. So a proxy that clears the field from each ``Fetch`` and passes
everything else on plays the old daemon exactly, in front of today's daemon. It has
no side socket next to it, so ``transport="auto"`` uses gRPC. Every ``Fetch`` request
as the client sent it is kept in ``requests``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc

from weightd.v1 import weightd_pb2 as pb

SERVICE = "weightd.v1.Weights"


class FieldForgettingProxy:
    """Fetch with ``forget(request)`` applied first; DescribeModel unchanged."""

    def __init__(self, target: str, sock: Path, forget: Callable[[pb.FetchRequest], None]) -> None:
        self.channel = grpc.insecure_channel(target)
        fetch_up = self.channel.unary_stream(f"/{SERVICE}/Fetch")
        describe_up = self.channel.unary_unary(f"/{SERVICE}/DescribeModel")
        self.requests: list[pb.FetchRequest] = []

        def fetch(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            self.requests.append(pb.FetchRequest.FromString(raw))
            request = pb.FetchRequest.FromString(raw)
            forget(request)
            yield from fetch_up(request.SerializeToString(), timeout=120)

        def describe(raw: bytes, context: grpc.ServicerContext) -> bytes:
            reply: bytes = describe_up(raw, timeout=60)
            return reply

        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Fetch": grpc.unary_stream_rpc_method_handler(fetch),
                "DescribeModel": grpc.unary_unary_rpc_method_handler(describe),
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((handler,))
        self.target = f"unix://{sock}"
        self.server.add_insecure_port(self.target)
        self.server.start()

    def close(self) -> None:
        self.server.stop(None)
        self.channel.close()


def without_slice_digest(target: str, sock: Path) -> FieldForgettingProxy:
    """A daemon from before ``FetchRequest.slice_digest`` (field 7): SHA-256, no kind named."""
    return FieldForgettingProxy(target, sock, lambda r: r.ClearField("slice_digest"))


def without_vocab_pad(target: str, sock: Path) -> FieldForgettingProxy:
    """A daemon from before ``Layout.vocab_pad`` (field 8): equal blocks, no padding named."""
    return FieldForgettingProxy(target, sock, lambda r: r.layout.ClearField("vocab_pad"))
