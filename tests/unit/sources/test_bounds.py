"""The bounds on reads from a store (``sources/bounds.py``) and the checks of each answer
(``sources/s3.py``): pure rules, by tables."""

from __future__ import annotations

from typing import Any

import pytest

from weightd.server.base import errors
from weightd.server.sources.bounds import StoreBounds, body_bytes
from weightd.server.sources.location import S3Location
from weightd.server.sources.s3 import RemoteObject, S3Store, listed_object
from weightd.server.sources.transport import Budget

B = StoreBounds(min_bytes_per_second=1000, rate_grace_seconds=10, request_seconds=5)
LOC = S3Location("models", "m/")


@pytest.mark.parametrize(
    ("elapsed", "received", "slow"),
    [
        (5.0, 0, False),  # inside the grace: judged later
        (10.0, 0, False),  # at its end
        (11.0, 999, True),  # one second past: 1000 bytes due
        (11.0, 1000, False),
        (60.0, 49_999, True),
        (60.0, 50_000, False),
    ],
)
def test_a_range_is_too_slow_below_the_rate_past_the_grace(
    elapsed: float, received: int, slow: bool
) -> None:
    assert B.too_slow(elapsed, received) is slow


def test_a_range_ends_at_the_latest_after_grace_plus_size_over_rate() -> None:
    assert B.range_seconds(0) == 10 and B.range_seconds(5000) == 15
    assert not B.too_slow(B.range_seconds(5000), 5000)
    assert body_bytes(100, 200) == 100


@pytest.mark.parametrize(
    ("rate", "grace", "piece"),
    [
        (64 << 10, 30.0, 960 << 10),  # the defaults: 960 KiB, half the grace's due
        (1 << 20, 30.0, 1 << 20),  # never more than 1 MiB gathered
        (256 << 10, 2.0, 256 << 10),  # tight bounds: counted every 256 KiB
        (1000, 1.0, 64 << 10),  # never less than 64 KiB
    ],
)
def test_a_body_is_counted_in_pieces_of_at_most_half_the_rate_due_in_the_grace(
    rate: int, grace: float, piece: int
) -> None:
    """The count of a body may lag its socket by one piece: at most half of what the
    grace window asks, so a store that keeps the minimum rate is never ended as slower
    (past the grace it owes rate x elapsed, and is counted at least that less a piece)."""
    bounds = StoreBounds(min_bytes_per_second=rate, rate_grace_seconds=grace)
    budget = Budget("s3://b/k", "range", seconds=60, max_bytes=1 << 30, rate=bounds)
    assert budget.piece_bytes == piece
    if piece < 1 << 20 and piece > 64 << 10:
        assert piece * 2 <= rate * grace
    unrated = Budget("s3://b/k", "HEAD", seconds=5, max_bytes=64 << 10)
    assert unrated.piece_bytes == 1 << 20


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        ({"Size": 1, "ETag": '"e"'}, "listing entry 7 has no Key"),
        ({"Key": "", "Size": 1, "ETag": '"e"'}, "listing entry 7 has no Key"),
        ({"Key": "m/a.json", "Size": "12x", "ETag": '"e"'}, "the store gave Size '12x'"),
        ({"Key": "m/a.json", "Size": -5, "ETag": '"e"'}, "the store gave Size '-5'"),
        ({"Key": "m/a.json", "Size": True, "ETag": '"e"'}, "the store gave Size 'True'"),
        ({"Key": "m/a.json", "Size": 1 << 60, "ETag": '"e"'}, "not a size"),
        ({"Key": "m/a.json", "Size": 1}, "the store gave no ETag"),
        ({"Key": "m/a.json", "Size": 1, "ETag": '"e"\nX: y'}, "not printable ASCII"),
    ],
)
def test_malformed_listing_entries_are_one_line_naming_the_entry(
    item: dict[str, Any], problem: str
) -> None:
    with pytest.raises(errors.ObjectStoreProtocolError) as caught:
        listed_object(LOC, item, 7)
    assert problem in str(caught.value)
    assert "\n" not in str(caught.value)


def test_odd_keys_are_skipped_not_refused() -> None:
    for key in ("m/sub/a.json", "m/.hidden", "other/a.json", "m/a\nb.json"):
        assert listed_object(LOC, {"Key": key, "Size": "x"}, 1) is None
    assert listed_object(LOC, {"Key": "m/a.json", "Size": "3", "ETag": '"e"'}, 1) == (
        RemoteObject("a.json", "m/a.json", 3, '"e"')
    )


OBJ = RemoteObject("w.safetensors", "m/w.safetensors", 100, '"abc"')


def _answer(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "ETag": '"abc"',
        "ContentRange": "bytes 10-19/100",
        "ContentLength": 10,
        "ResponseMetadata": {"HTTPStatusCode": 206},
    }
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize(
    ("answer", "error", "problem"),
    [
        (_answer(ETag=None), errors.ObjectStoreProtocolError, "carries no ETag"),
        (_answer(ETag='"other"'), errors.ObjectChanged, "ETag is"),
        (_answer(ContentRange=None), errors.ObjectStoreProtocolError, "carries no Content-Range"),
        (_answer(ContentRange="bytes 10-19/abc"), errors.ObjectStoreProtocolError, "is not"),
        (_answer(ContentRange="bytes 10-19/*"), errors.ObjectStoreProtocolError, "is not"),
        (_answer(ContentRange="bytes 0-9/100"), errors.ObjectStoreProtocolError, "other bytes"),
        (_answer(ContentRange="bytes 10-19/101"), errors.ObjectChanged, "101 bytes now"),
        (_answer(ContentLength=11), errors.ObjectTruncated, "announces 11 bytes"),
        (_answer(ContentLength="x"), errors.ObjectStoreProtocolError, "Content-Length"),
    ],
)
def test_an_answer_must_prove_its_version_and_its_bytes(
    answer: dict[str, Any], error: type[Exception], problem: str
) -> None:
    with pytest.raises(error) as caught:
        S3Store._check_answer("s3://models/m/w.safetensors", OBJ, 10, 20, answer)
    assert problem in str(caught.value)


def test_a_whole_object_may_come_without_content_range() -> None:
    whole = _answer(ContentRange=None, ContentLength=100)
    whole["ResponseMetadata"] = {"HTTPStatusCode": 200}
    S3Store._check_answer("s3://models/m/w.safetensors", OBJ, 0, 100, whole)
    S3Store._check_answer("s3://models/m/w.safetensors", OBJ, 10, 20, _answer())
