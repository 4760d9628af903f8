"""Daemon-shaped Fetch streams of wire bytes, for the receiver's tests."""

from __future__ import annotations

import hashlib

import blake3

from weightd.server.rpc.wire import EncodedResponse
from weightd.v1 import weightd_pb2 as pb


class FakeStream:
    """A Fetch call's iterator of wire bytes; remembers whether it was cancelled."""

    def __init__(self, messages: list[bytes]) -> None:
        self._it = iter(messages)
        self.cancelled = False

    def __iter__(self) -> FakeStream:
        return self

    def __next__(self) -> bytes:
        return next(self._it)

    def cancel(self) -> None:
        self.cancelled = True


def _rank(
    payloads: list[bytes], per_message: int = 4, *, kind: str = "", named: str | None = None
) -> list[bytes]:
    """A daemon-shaped stream of uint8 tensors, ``per_message`` payload bytes a message.

    ``kind``: the slice digests' kind ("": SHA-256, as every daemon sends by default);
    ``named``: what the first message names as the kind (None: ``kind``).
    """
    first = pb.FetchResponse(model_fingerprint="fp", slice_digest=kind if named is None else named)
    out = [first.SerializeToString()]
    msg = EncodedResponse()
    for index, data in enumerate(payloads):
        header: pb.SliceHeader | None = pb.SliceHeader(
            name=f"t{index}", dtype="U8", shape=[len(data)], nbytes=len(data)
        )
        if kind == "blake3":
            digest = "blake3:" + blake3.blake3(data).hexdigest()
        else:
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
        pieces = [data[o : o + per_message] for o in range(0, len(data), per_message)] or [b""]
        offset = 0
        for i, piece in enumerate(pieces):
            if not msg.empty and msg.payload_bytes + len(piece) > per_message:
                out.append(msg.serialize())
                msg = EncodedResponse()
            last = i == len(pieces) - 1
            msg.add_chunk(index, offset, piece, header=header, digest=digest if last else "")
            header = None
            offset += len(piece)
    msg.set_done(pb.FetchDone(num_tensors=len(payloads), total_bytes=sum(map(len, payloads))))
    out.append(msg.serialize())
    return out


PAYLOADS = [b"0123456789", b"", b"abc", bytes(range(256)) * 3]


def _tampered(raw: list[bytes], old: bytes, new: bytes) -> list[bytes]:
    hit = [m.replace(old, new) for m in raw]
    assert hit != raw
    return hit
