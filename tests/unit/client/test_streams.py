"""Splitting a rank over several Fetch streams (``weightd.client.transports.streams``),
pure parts."""

from __future__ import annotations

import threading

import pytest

from weightd.client.base.errors import NotFoundError
from weightd.client.transports.streams import fetch_in_streams, split_by_bytes

SIZES = [("a", 100), ("b", 10), ("c", 60), ("d", 40), ("e", 0), ("f", 90)]


@pytest.mark.parametrize(
    ("n", "groups"),
    [
        (1, [["a", "b", "c", "d", "e", "f"]]),
        (2, [["a", "b", "d", "e"], ["c", "f"]]),  # 150 / 150 bytes
        (3, [["a", "e"], ["b", "f"], ["c", "d"]]),  # 100 / 100 / 100
        (6, [["a"], ["f"], ["c"], ["d"], ["b"], ["e"]]),  # biggest first
        (9, [["a"], ["f"], ["c"], ["d"], ["b"], ["e"]]),  # never an empty group
    ],
)
def test_split_by_bytes_balances_and_keeps_order(n: int, groups: list[list[str]]) -> None:
    got = split_by_bytes(SIZES, n)
    assert got == groups
    assert sorted(x for g in got for x in g) == sorted(name for name, _ in SIZES)


def test_split_of_nothing_is_nothing() -> None:
    assert split_by_bytes([], 4) == []


def test_a_failed_stream_fails_the_fetch_and_stops_the_others() -> None:
    seen: list[str] = []

    def fetch_group(i: int, names: list[str], progress) -> dict:  # type: ignore[no-untyped-def,type-arg]
        if i == 0:
            raise NotFoundError("tensor 'x' is not served")
        out = {}
        for index, name in enumerate(names):
            try:
                progress(index, name)
            except Exception as exc:  # the sibling's failure reaches this stream
                seen.append(type(exc).__name__)
                raise
            out[name] = name
        return out

    gate = threading.Event()

    def slow(i: int, names: list[str], progress) -> dict:  # type: ignore[no-untyped-def,type-arg]
        if i == 1:
            gate.wait(10)  # runs after stream 0 failed
        return fetch_group(i, names, progress)

    def failing(i: int, names: list[str], progress) -> dict:  # type: ignore[no-untyped-def,type-arg]
        try:
            return slow(i, names, progress)
        finally:
            if i == 0:
                gate.set()

    with pytest.raises(NotFoundError, match="'x'"):
        fetch_in_streams([["x"], ["y", "z"]], failing, None)
    assert seen == ["_SiblingFailed"]


def test_streams_merge_in_group_order_and_report_progress() -> None:
    calls: list[tuple[int, str]] = []
    got = fetch_in_streams(
        [["a", "c"], ["b"]],
        lambda i, names, progress: {n: progress(k, n) or n.upper() for k, n in enumerate(names)},
        lambda index, name: calls.append((index, name)),
    )
    assert got == {"a": "A", "c": "C", "b": "B"}
    assert sorted(calls) == [(0, "a"), (0, "b"), (1, "c")]


def test_merged_report_adds_up_every_stream_count() -> None:
    """One report for a fetch of several streams: a recheck or a restart on any stream
    shows in the fetch's report (the counts are summed, positions concatenated)."""
    from weightd.client.transports.resumable import ResumeReport
    from weightd.client.transports.streams import merge_reports

    a = ResumeReport(streams=2, resumed_at=[3], rechecks=1, received_bytes=100, resent_bytes=10)
    b = ResumeReport(streams=3, resumed_at=[1, 4], restarts=1, received_bytes=50, resent_bytes=5)
    a.slice_digest = b.slice_digest = "blake3"
    got = merge_reports([a, b])
    assert (got.streams, got.resumed_at, got.restarts, got.rechecks) == (5, [3, 1, 4], 1, 1)
    assert (got.received_bytes, got.resent_bytes, got.slice_digest) == (150, 15, "blake3")
    assert merge_reports([]) == ResumeReport()
