"""The client's retry policy (``weightd.client.base.retry``): pure rules, table-tested.

The daemon's side of a retried Fetch, the resume decision, is tested in
``tests/unit/rpc/test_resume.py``.
"""

from __future__ import annotations

import random

import grpc
import pytest

from weightd.client import RetryPolicy, RetryStats
from weightd.client.base.errors import (
    DataLossError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
    WeightdError,
)
from weightd.client.base.retry import call_with_retry


class Clock:
    """Time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def failing(errors: list[WeightdError], result: str = "ok") -> tuple[list[int], object]:
    calls = [0]

    def fn() -> str:
        calls[0] += 1
        if errors:
            raise errors.pop(0)
        return result

    return calls, fn


def run(policy: RetryPolicy | None, fn: object, clock: Clock, stats: RetryStats) -> object:
    return call_with_retry(
        fn,  # type: ignore[arg-type]
        policy,
        stats,
        rng=random.Random(1),
        sleep=clock.sleep,
        clock=lambda: clock.now,
    )


def test_delays_grow_exponentially_with_jitter_inside_their_bounds() -> None:
    policy = RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0)
    rng = random.Random(0)
    for retry, cap in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]):
        delays = {policy.delay(retry, rng) for _ in range(50)}
        assert all(cap / 2 <= d <= cap for d in delays), (retry, cap, delays)
        assert len(delays) > 1  # jittered, not a fixed schedule


@pytest.mark.parametrize("error", [ResourceExhaustedError("busy"), UnavailableError("restart")])
def test_retryable_codes_are_retried_until_success(error: WeightdError) -> None:
    clock, stats = Clock(), RetryStats()
    calls, fn = failing([error, error, error])
    assert run(RetryPolicy(), fn, clock, stats) == "ok"
    assert calls[0] == 4 and stats.retries[error.code.name] == 3
    assert stats.waited_seconds == pytest.approx(sum(clock.sleeps))


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgumentError("bad"),
        DataLossError("digest"),
        WeightdError("?", grpc.StatusCode.ABORTED),
    ],
)
def test_other_codes_are_raised_at_once(error: WeightdError) -> None:
    clock, stats = Clock(), RetryStats()
    calls, fn = failing([error])
    with pytest.raises(type(error)):
        run(RetryPolicy(), fn, clock, stats)
    assert calls[0] == 1 and stats.total == 0 and clock.sleeps == []


def test_total_time_without_progress_is_bounded() -> None:
    clock, stats = Clock(), RetryStats()
    policy = RetryPolicy(initial_backoff=0.5, max_backoff=2.0, total_seconds=10.0)
    calls, fn = failing([UnavailableError("down")] * 1000)
    with pytest.raises(UnavailableError):
        run(policy, fn, clock, stats)
    assert clock.now <= 10.0 and stats.gave_up == 1
    assert 5 <= calls[0] < 1000


def test_max_attempts_bounds_the_attempts() -> None:
    clock, stats = Clock(), RetryStats()
    calls, fn = failing([UnavailableError("down")] * 10)
    with pytest.raises(UnavailableError):
        run(RetryPolicy(max_attempts=3), fn, clock, stats)
    assert calls[0] == 3


def test_no_policy_means_no_retry() -> None:
    clock, stats = Clock(), RetryStats()
    calls, fn = failing([UnavailableError("down")])
    with pytest.raises(UnavailableError):
        run(None, fn, clock, stats)
    assert calls[0] == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"codes": frozenset({grpc.StatusCode.INVALID_ARGUMENT})},
        {"codes": frozenset({grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNAVAILABLE})},
        {"initial_backoff": 0},
        {"initial_backoff": 3, "max_backoff": 1},
        {"multiplier": 0.5},
    ],
)
def test_policies_that_would_retry_the_wrong_thing_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
