"""Receiving slices straight into caller-provided tensors (``load_into``'s gRPC path)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.client.wire_streams import PAYLOADS, FakeStream, _rank, _tampered
from weightd.client.base.errors import DataLossError
from weightd.client.receive.stream import RankReceiver, fits

U8 = torch.uint8


class Subclass(torch.Tensor):
    """Stands for tensor subclasses (DTensor, float8 wrappers) that load_state_dict handles."""


@pytest.mark.parametrize(
    ("dest", "ok"),
    [
        (torch.zeros(4, 6, dtype=U8), True),
        (torch.zeros(24, dtype=U8)[:24].view(4, 6), True),  # a contiguous view is fine
        (torch.zeros(6, 4, dtype=U8).t(), False),  # strided
        (torch.zeros(4, 6, dtype=torch.int8), False),  # would need a cast
        (torch.zeros(4, 7, dtype=U8), False),  # another shape
        (torch.zeros(24, dtype=U8), False),  # same bytes, another shape
        (torch.zeros(4, 6, dtype=U8, device="meta"), False),  # no memory to write
        (torch.zeros(4, 6, dtype=U8).to_sparse(), False),
        (torch.nn.Parameter(torch.zeros(4, 6, dtype=U8), requires_grad=False), True),
        (torch.zeros(4, 6, dtype=U8).as_subclass(Subclass), False),  # memory not just bytes
    ],
)
def test_fits_only_dense_contiguous_cpu_tensors_of_the_exact_dtype_and_shape(
    dest: torch.Tensor, ok: bool
) -> None:
    assert fits(dest, U8, (4, 6)) is ok


def test_fits_refuses_lazy_negation_and_conjugation_views() -> None:
    """Contiguous views whose memory does not hold what they read (a raw write would
    store the bytes un-negated / un-conjugated)."""
    z = torch.zeros(3, dtype=torch.complex64)
    assert fits(z, torch.complex64, (3,)) and z.conj().is_contiguous()
    assert not fits(z.conj(), torch.complex64, (3,))
    x = torch.zeros(3)
    neg = x._neg_view()  # type: ignore[attr-defined]
    assert fits(x, torch.float32, (3,)) and neg.is_contiguous()
    assert not fits(neg, torch.float32, (3,))


def test_receiver_writes_into_the_given_tensors_where_they_fit() -> None:
    into = {
        "t0": torch.zeros(len(PAYLOADS[0]), dtype=U8),
        "t2": torch.zeros(len(PAYLOADS[2]) + 1, dtype=U8),  # wrong shape: left alone
        "t3": torch.zeros(len(PAYLOADS[3]), dtype=U8),
    }
    before = into["t2"].clone()
    r = RankReceiver(into=into)
    r.consume(FakeStream(_rank(PAYLOADS)))
    assert r.tensors["t0"] is into["t0"] and r.tensors["t3"] is into["t3"]
    assert bytes(into["t0"].numpy()) == PAYLOADS[0]
    assert bytes(into["t3"].numpy()) == PAYLOADS[3]
    assert r.tensors["t2"] is not into["t2"] and bytes(r.tensors["t2"].numpy()) == PAYLOADS[2]
    assert torch.equal(into["t2"], before)


def test_a_failed_fetch_may_leave_given_tensors_overwritten_but_never_returns_them() -> None:
    """The documented price of receiving in place: bytes that failed their digest stay
    in the caller's tensor, and the fetch raises instead of handing anything out."""
    into = {"t2": torch.zeros(3, dtype=U8)}
    r = RankReceiver(into=into)
    with pytest.raises(DataLossError, match=r"'t2'.*hash to"):
        r.consume(FakeStream(_tampered(_rank(PAYLOADS), b"abc", b"abd")))
    assert "t2" not in r.tensors
    assert bytes(into["t2"].numpy()) == b"abd"
