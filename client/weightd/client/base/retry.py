"""Retrying calls the daemon refused for now: exponential backoff with jitter, bounded.

Only two codes mean "the same request can succeed later": RESOURCE_EXHAUSTED (the
daemon's concurrency limit, ``--max-concurrent-rpcs``, or a full side channel) and
UNAVAILABLE (the daemon is restarting, draining, or still verifying the model).
Everything else (INVALID_ARGUMENT, DATA_LOSS, NOT_FOUND, ...) says something about
the request or the data that waiting does not change, so it is raised at once; a
policy naming another code is refused when it is built.

The wait before retry ``n`` (from 0) is drawn uniformly from ``[cap / 2, cap]`` with
``cap = min(max_backoff, initial_backoff * multiplier ** n)`` ("equal jitter"): the
half that is random spreads clients that were refused together, the fixed half makes
each of them really back off. The time spent retrying is bounded by
``total_seconds``, counted from the first failure *since the last progress*: a long
fetch that resumed after a restart gets the whole budget again when it is cut a
second time, while a daemon that never comes back costs at most ``total_seconds``.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import WeightdError

if TYPE_CHECKING:
    import grpc

T = TypeVar("T")


def retryable() -> frozenset[grpc.StatusCode]:
    """The only codes a policy may retry (``RETRYABLE``). gRPC is imported here, not
    with the module: a same-host fetch never loads it (``weightd.client.transports.localwire``)."""
    import grpc

    return frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


def __getattr__(name: str) -> Any:
    if name == "RETRYABLE":
        return retryable()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class RetryPolicy:
    """When and how long :class:`~weightd.client.WeightClient` retries a refused call."""

    #: First wait's upper bound, seconds.
    initial_backoff: float = 0.05
    #: Largest wait between two attempts, seconds.
    max_backoff: float = 2.0
    #: Growth of the wait's bound per retry.
    multiplier: float = 2.0
    #: Longest time spent failing without progress before the last error is raised.
    total_seconds: float = 60.0
    #: Most attempts in a row without progress (0: bounded by time only).
    max_attempts: int = 0
    #: Codes retried: a subset of :data:`RETRYABLE`.
    codes: frozenset[grpc.StatusCode] = field(default_factory=retryable)
    #: Only refusals with one of these reasons (the daemon's error class, as
    #: ``WeightdError.reason``); empty: any refusal with one of :attr:`codes`.
    reasons: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError(
                f"need 0 < initial_backoff <= max_backoff, got {self.initial_backoff} "
                f"and {self.max_backoff}"
            )
        if self.multiplier < 1 or self.total_seconds < 0 or self.max_attempts < 0:
            raise ValueError(
                f"need multiplier >= 1, total_seconds >= 0, max_attempts >= 0; got "
                f"{self.multiplier}, {self.total_seconds}, {self.max_attempts}"
            )
        extra = set(self.codes) - retryable()
        if extra:
            names = ", ".join(sorted(c.name for c in extra))
            raise ValueError(
                f"codes {names} are never retried: only RESOURCE_EXHAUSTED and UNAVAILABLE "
                "mean the same request can succeed later"
            )

    def retries(self, error: WeightdError) -> bool:
        """Whether this policy asks again after ``error``."""
        return error.code in self.codes and (not self.reasons or error.reason in self.reasons)

    def delay(self, retry: int, rng: random.Random) -> float:
        """The wait before retry number ``retry`` (0-based): in ``[cap / 2, cap]``."""
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier ** min(retry, 64))
        return rng.uniform(cap / 2, cap)


@dataclass
class RetryStats:
    """What retrying cost, accumulated over a client's life (read it, or reset it)."""

    retries: Counter[str] = field(default_factory=Counter)  # by status code name
    waited_seconds: float = 0.0
    gave_up: int = 0  # calls that raised a retryable error after the budget ran out

    @property
    def total(self) -> int:
        """Retries of every code together."""
        return sum(self.retries.values())


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy | None,
    stats: RetryStats,
    *,
    progress: Callable[[], int] = lambda: 0,
    rng: random.Random | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """``fn()``, retried under ``policy`` (None: once, no retry).

    ``progress`` returns a number that grows when an attempt got somewhere (tensors
    received): a failure after progress starts a fresh backoff and time budget.
    """
    if policy is None:
        return fn()
    rng = rng or random.Random()  # noqa: S311 - jitter, not secrets
    retry = 0
    window_start: float | None = None
    seen = progress()
    while True:
        try:
            return fn()
        except WeightdError as exc:
            if not policy.retries(exc):
                raise
            now = clock()
            if progress() != seen or window_start is None:
                seen, retry, window_start = progress(), 0, now
            wait = policy.delay(retry, rng)
            out_of_attempts = policy.max_attempts and retry + 1 >= policy.max_attempts
            if out_of_attempts or now - window_start + wait > policy.total_seconds:
                stats.gave_up += 1
                raise
            stats.retries[exc.code.name] += 1
            stats.waited_seconds += wait
            sleep(wait)
            retry += 1
