"""Fetch messages built twice: by the daemon's hand encoder and by protobuf.

Shared by the encoder's byte-identity tests (``tests/unit/rpc/test_wire.py``) and the
client parser's tests (``tests/unit/client/test_fetchwire.py``), which parse what the
encoder writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightd.server.rpc.wire import EncodedResponse
from weightd.v1 import weightd_pb2 as pb

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1

HEADER = pb.SliceHeader(
    name="model.layers.0.mlp.down_proj.weight",
    dtype="BF16",
    shape=[4096, 5632],
    nbytes=4096 * 5632 * 2,
    split_dim=1,
    replicated=False,
)


def _filler(data: bytes) -> Callable[[memoryview], None]:
    def fill(view: memoryview) -> None:
        assert view.nbytes == len(data)
        view[:] = data

    return fill


def _pair(
    chunks: list[dict[str, Any]],
    done: pb.FetchDone | None = None,
    fingerprint: str = "",
    *,
    in_place: bool = False,
) -> tuple[bytes, bytes]:
    """(hand-encoded, protobuf-serialized) bytes of the same message.

    ``in_place``: payloads are added as deferred fills (``add_chunk_into``), written
    into the message when it is built, as the daemon's Fetch stream does.
    """
    enc = EncodedResponse()
    msg = pb.FetchResponse(model_fingerprint=fingerprint)
    for c in chunks:
        header = c.get("header")
        data = c.get("data", b"")
        if in_place and len(data):
            enc.add_chunk_into(
                c.get("index", 0),
                c.get("offset", 0),
                len(data),
                _filler(bytes(data)),
                header=header,
                digest=c.get("digest", ""),
            )
        else:
            enc.add_chunk(
                c.get("index", 0),
                c.get("offset", 0),
                data,
                header=header,
                digest=c.get("digest", ""),
            )
        piece = msg.chunks.add(
            index=c.get("index", 0),
            offset=c.get("offset", 0),
            data=bytes(c.get("data", b"")),
            digest=c.get("digest", ""),
        )
        if header is not None:
            piece.header.CopyFrom(header)
    if done is not None:
        enc.set_done(done)
        msg.done.CopyFrom(done)
    enc.set_fingerprint(fingerprint)
    return enc.serialize(), msg.SerializeToString()
