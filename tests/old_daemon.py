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


#: Rewrites one Fetch response: (the stream's number from 0, its message's number
#: from 0, the message's wire bytes) -> the wire bytes passed on.
Alter = Callable[[int, int, bytes], bytes]


class FieldForgettingProxy:
    """Fetch with ``forget(request)`` applied first; DescribeModel unchanged.

    ``alter``, when given, rewrites each Fetch response on its way back (what a
    corrupting hop between daemon and client would do).
    """

    def __init__(
        self,
        target: str,
        sock: Path,
        forget: Callable[[pb.FetchRequest], None],
        alter: Alter | None = None,
    ) -> None:
        self.channel = grpc.insecure_channel(target)
        fetch_up = self.channel.unary_stream(f"/{SERVICE}/Fetch")
        describe_up = self.channel.unary_unary(f"/{SERVICE}/DescribeModel")
        self.requests: list[pb.FetchRequest] = []

        def fetch(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            stream = len(self.requests)
            self.requests.append(pb.FetchRequest.FromString(raw))
            request = pb.FetchRequest.FromString(raw)
            forget(request)
            try:
                for i, message in enumerate(fetch_up(request.SerializeToString(), timeout=120)):
                    yield message if alter is None else alter(stream, i, message)
            except grpc.RpcError as exc:  # the daemon's status, passed on as it is
                context.abort(exc.code(), exc.details() or "")

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


def without_rehash(target: str, sock: Path) -> FieldForgettingProxy:
    """A daemon from before ``FetchRequest.rehash`` (field 8), in front of one that does
    not re-hash every stream: what an old daemon run with ``--no-fetch-rehash`` does."""
    return FieldForgettingProxy(target, sock, lambda r: r.ClearField("rehash"))


def corrupting_first_stream(target: str, sock: Path) -> tuple[FieldForgettingProxy, list[int]]:
    """Flips the first payload byte of the second tensor in the first Fetch stream
    (index 1): bytes that went bad between a sound daemon and the client. The list
    gets the index of the tensor whose byte was flipped."""
    flipped: list[int] = []

    def alter(stream: int, i: int, raw: bytes) -> bytes:
        if stream or flipped:
            return raw
        message = pb.FetchResponse.FromString(raw)
        for chunk in message.chunks:
            if chunk.data and chunk.index >= 1:
                chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
                flipped.append(chunk.index)
                return message.SerializeToString()
        return raw

    return FieldForgettingProxy(target, sock, lambda r: None, alter), flipped


def without_vocab_pad(target: str, sock: Path) -> FieldForgettingProxy:
    """A daemon from before ``Layout.vocab_pad`` (field 8): equal blocks, no padding named."""
    return FieldForgettingProxy(target, sock, lambda r: r.layout.ClearField("vocab_pad"))
