"""The hand-written side-channel codec against the generated protobuf classes, both ways.

Every field a shared-memory fetch sends or reads is set to a value that is not its
default (so it is on the wire), and the bytes must mean the same to both codecs;
unknown fields (a newer daemon's) are skipped; malformed bytes are refused.
"""

from __future__ import annotations

import pytest

from weightd.client import Layout, Wanted
from weightd.client.transports import localwire
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

LAYOUT = Layout(
    tp_size=4,
    tp_rank=3,
    pp_size=2,
    pp_rank=1,
    ep_size=2,
    ep_rank=1,
    pp_layers=(300, 1),
    vocab_pad=64,
)


def test_an_acquire_is_what_protobuf_reads() -> None:
    data = localwire.encode_acquire(
        Wanted(LAYOUT, "m\u00e9", ("a", "b.weight"), version=2**33 + 5, adapter="ad"),
        placement=localwire.PLACEMENT_CUDA,
        gpu_uuid="GPU-1",
        slice_digests=["blake3", "sha256"],
        no_wait=True,
    )
    req = lpb.LocalRequest.FromString(data)
    assert req.WhichOneof("request") == "acquire"
    a = req.acquire
    assert (a.model, list(a.names), a.placement, a.gpu_uuid, a.adapter) == (
        "m\u00e9",
        ["a", "b.weight"],
        lpb.PLACEMENT_CUDA,
        "GPU-1",
        "ad",
    )
    assert list(a.slice_digests) == ["blake3", "sha256"] and a.no_wait
    assert a.version == 2**33 + 5
    assert Layout.of_proto(a.layout) == LAYOUT
    # Defaults stay off the wire, as protobuf leaves them.
    plain = localwire.encode_acquire(Wanted(Layout()))
    assert (
        plain
        == lpb.LocalRequest(
            acquire=lpb.AcquirePack(layout=pb.Layout(tp_size=1, pp_size=1, ep_size=1), placement=1)
        ).SerializeToString()
    )


def test_an_attach_is_what_protobuf_reads() -> None:
    data = localwire.encode_attach(
        boot_id="b", pack_id=2**40 + 3, names=["x"], slice_digests=["blake3"]
    )
    at = lpb.LocalRequest.FromString(data).attach
    assert (at.boot_id, at.pack_id, list(at.names), list(at.slice_digests)) == (
        "b",
        2**40 + 3,
        ["x"],
        ["blake3"],
    )


def _grant() -> lpb.PackGrant:
    return lpb.PackGrant(
        boot_id="boot",
        pack_id=7,
        model="llama",
        layout=LAYOUT.to_proto(),
        placement=lpb.PLACEMENT_HOST,
        size_bytes=1 << 33,
        entries=[
            lpb.PackEntry(
                name=f"t{i}",
                dtype="BF16",
                shape=[3, 2**20 + i],
                offset=256 * i,
                nbytes=12 + i,
                digest=f"blake3:{i:064x}",
                split_dim=i % 2,
                replicated=bool(i % 2),
            )
            for i in range(3)
        ],
        cuda_ipc_handle=b"\x00\x01" * 32,
        gpu_uuid="GPU-x",
        pinned=True,
        built=True,
        adapter=pb.AdapterInfo(name="ad", version=3, scaling={"q": 0.5}),
        huge_pages=True,
        version=12,
    )


def test_a_grant_reads_as_protobuf_wrote_it() -> None:
    want = _grant()
    raw = lpb.LocalResponse(grant=want).SerializeToString()
    got = localwire.decode_response(raw).grant
    assert got is not None
    for name in ("boot_id", "pack_id", "model", "placement", "size_bytes", "cuda_ipc_handle"):
        assert getattr(got, name) == getattr(want, name), name
    assert (got.gpu_uuid, got.pinned, got.built, got.huge_pages) == ("GPU-x", True, True, True)
    assert got.version == 12
    assert got.layout == LAYOUT
    assert got.adapter == want.adapter.SerializeToString()
    for e, w in zip(got.entries, want.entries, strict=True):
        assert (e.name, e.dtype, e.shape, e.offset, e.nbytes, e.digest) == (
            w.name,
            w.dtype,
            list(w.shape),
            w.offset,
            w.nbytes,
            w.digest,
        )
        assert (e.split_dim, e.replicated) == (w.split_dim, w.replicated)
    assert lpb.PackGrant.FromString(got.raw) == want


def test_hello_error_and_stats_read_as_protobuf_wrote_them() -> None:
    hello = lpb.LocalHello(
        protocol_version=1,
        boot_id="b",
        placements=[lpb.PLACEMENT_HOST, lpb.PLACEMENT_CUDA],
        gpu_uuids=["g1", "g2"],
        pid=4242,
        refused=lpb.LocalError(code=8, detail="full", transport=True),
    )
    got = localwire.decode_hello(hello.SerializeToString())
    assert (got.protocol_version, got.boot_id, got.placements, got.gpu_uuids, got.pid) == (
        1,
        "b",
        [1, 2],
        ["g1", "g2"],
        4242,
    )
    assert got.refused is not None and (got.refused.code, got.refused.detail) == (8, "full")
    err = lpb.LocalResponse(
        error=lpb.LocalError(code=14, detail="building", transport=True, pending=True)
    )
    e = localwire.decode_response(err.SerializeToString()).error
    assert e is not None and (e.code, e.detail, e.transport, e.pending) == (
        14,
        "building",
        True,
        True,
    )
    # The daemon's error class and fields travel too (gRPC's ErrorInfo, on the side socket).
    err = lpb.LocalResponse(
        error=lpb.LocalError(
            code=5,
            detail="no model 'x'",
            reason="ModelNotFound",
            metadata={"model": "x", "error_lineage": "WeightdError", "": "empty key"},
        )
    )
    e = localwire.decode_response(err.SerializeToString()).error
    assert e is not None and (e.code, e.reason, e.pending, e.transport) == (
        5,
        "ModelNotFound",
        False,
        False,
    )
    assert e.metadata == {"model": "x", "error_lineage": "WeightdError", "": "empty key"}
    stats = lpb.LocalStats(host_bytes=5, packs=[lpb.PackStat(pack_id=1, declared=True)])
    raw = localwire.decode_response(lpb.LocalResponse(stats=stats).SerializeToString()).stats
    assert raw is not None and lpb.LocalStats.FromString(raw) == stats


def test_unknown_fields_are_skipped() -> None:
    raw = _grant().SerializeToString()
    extra = (
        bytes([(99 << 3 | 0) & 0x7F | 0x80, 99 >> 4])
        + b"\x05"  # field 99, varint 5
        + bytes([(98 << 3 | 2) & 0x7F | 0x80, 98 >> 4])
        + b"\x02ab"  # field 98, 2 bytes
        + bytes([(97 << 3 | 5) & 0x7F | 0x80, 97 >> 4])
        + b"\x00\x00\x00\x00"  # fixed32
        + bytes([(96 << 3 | 1) & 0x7F | 0x80, 96 >> 4])
        + b"\x00" * 8  # fixed64
    )
    assert localwire.decode_grant(raw + extra).pack_id == 7


@pytest.mark.parametrize(
    "raw",
    [
        b"\x08",  # a varint cut short
        b"\x12\x05ab",  # a field longer than the message
        b"\x0b",  # wire type 3 (groups): never written by protobuf 3
        b"\x00\x01",  # field number 0
        b"\x1a\x02\xff\xfe",  # a string that is not UTF-8 (model, field 3)
        b"\x10\x02ab",  # pack_id (a number) length-delimited
        b"\x08" + b"\xff" * 11,  # an overlong varint
    ],
)
def test_malformed_grants_are_refused(raw: bytes) -> None:
    with pytest.raises(localwire.WireError):
        localwire.decode_grant(raw)
