"""A pack granted for another layout than the one asked for is never handed out."""

from __future__ import annotations

import pytest

from weightd.client import Layout, UnavailableError
from weightd.client.transports.local_fetch import _check_granted_layout
from weightd.client.transports.localwire import Grant, decode_grant
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb


def _grant(layout: pb.Layout) -> Grant:
    """A grant as the client reads it off the side socket."""
    return decode_grant(lpb.PackGrant(layout=layout).SerializeToString())


def test_a_tp_only_grant_for_a_stage_request_is_a_transport_failure() -> None:
    # What a daemon from before whole-layout packs answers: the TP fields only.
    grant = _grant(pb.Layout(tp_size=2, tp_rank=1))
    with pytest.raises(UnavailableError, match="predates pipeline/expert") as err:
        _check_granted_layout(grant, Layout(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1), "shm")
    assert err.value.transport == "shm"  # so transport="auto" falls back to gRPC


@pytest.mark.parametrize(
    ("granted", "asked"),
    [
        (pb.Layout(tp_size=2, tp_rank=1), Layout(tp_size=2, tp_rank=1)),  # an older daemon
        (
            pb.Layout(tp_size=2, tp_rank=1, pp_size=1, pp_rank=0, ep_size=1, ep_rank=0),
            Layout(tp_size=2, tp_rank=1),
        ),
        (
            pb.Layout(tp_size=1, tp_rank=0, pp_size=2, pp_rank=1, pp_layers=[1, 1]),
            Layout(pp_size=2, pp_rank=1, pp_layers=(1, 1)),
        ),
    ],
)
def test_a_grant_for_the_asked_layout_passes(granted: pb.Layout, asked: Layout) -> None:
    _check_granted_layout(_grant(granted), asked, "shm")


def test_another_rank_is_refused_too() -> None:
    with pytest.raises(UnavailableError):
        _check_granted_layout(
            _grant(pb.Layout(tp_size=2, tp_rank=0)),
            Layout(tp_size=2, tp_rank=1),
            "shm",
        )


def test_an_old_daemons_grant_without_vocab_pad_is_a_transport_failure() -> None:
    """A daemon from before ``vocab_pad`` plans equal blocks and grants a layout without it."""
    grant = _grant(pb.Layout(tp_size=2, tp_rank=0))
    with pytest.raises(UnavailableError, match="or vocab_pad") as err:
        _check_granted_layout(grant, Layout(tp_size=2, tp_rank=0, vocab_pad=64), "shm")
    assert err.value.transport == "shm"  # transport="auto" falls back to gRPC, which refuses
    _check_granted_layout(
        _grant(pb.Layout(tp_size=2, tp_rank=0, vocab_pad=64)),
        Layout(tp_size=2, tp_rank=0, vocab_pad=64),
        "shm",
    )
