"""Every string of every request is bounded by its field name; errors quote cut short."""

from __future__ import annotations

import pytest

from weightd.server.base.bounds import DEFAULT_FIELD_BYTES, FIELD_LIMITS, MAX_REPEATED, check_fields
from weightd.server.base.errors import RequestTooLarge, echo
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb


@pytest.mark.parametrize(
    ("msg", "problem"),
    [
        (pb.FetchRequest(model="m" * 256, names=["n" * 1024] * 3), None),
        (pb.FetchRequest(model="m" * 257), "field model is 257 bytes"),
        (pb.FetchRequest(names=["ok", "n" * 1025]), "field names is 1025 bytes"),
        (pb.FetchRequest(names=["a"] * MAX_REPEATED), None),
        (pb.FetchRequest(names=["a"] * (MAX_REPEATED + 1)), f"the limit is {MAX_REPEATED}"),
        (pb.LoadAdapterRequest(source_dir="/" + "d" * 4095), None),
        (pb.LoadAdapterRequest(source_dir="/" + "d" * 4096), "field source_dir is 4097 bytes"),
        (pb.DescribeModelRequest(model="é" * 129), "field model is 258 bytes"),  # bytes, not chars
        # nested messages are walked, named by their path
        (lpb.LocalRequest(acquire=lpb.AcquirePack(model="x" * 300)), "field acquire.model is 300"),
        (lpb.LocalRequest(attach=lpb.AttachPack(boot_id="b" * 2000)), "field attach.boot_id"),
    ],
)
def test_check_fields(msg: object, problem: str | None) -> None:
    if problem is None:
        check_fields(msg)  # type: ignore[arg-type]
        return
    with pytest.raises(RequestTooLarge, match=problem) as err:
        check_fields(msg)  # type: ignore[arg-type]
    assert len(str(err.value)) < 300


def test_unnamed_fields_get_the_default_bound() -> None:
    assert "boot_id" not in FIELD_LIMITS
    check_fields(lpb.AttachPack(boot_id="b" * DEFAULT_FIELD_BYTES))
    with pytest.raises(RequestTooLarge):
        check_fields(lpb.AttachPack(boot_id="b" * (DEFAULT_FIELD_BYTES + 1)))


def test_echo_cuts_long_strings_and_keeps_short_ones() -> None:
    assert echo("llama") == "'llama'"
    long = echo("x" * 10_000)
    assert long.endswith("... (10000 bytes)") and len(long) < 120
