"""Every bound on a read from an object store, stated once (pure: values and rules).

The store and the network between are outside weightd's control: a misconfigured
proxy, a store that drips one byte every two seconds, a compromised bucket that
answers a listing with 400,000 keys or a body that never ends. Each answer is
therefore read under a bound on its bytes *and* on its time, and the bound that is
hit first ends the request with one line naming the object and the bound. The SDK's
own ``connect_timeout``/``read_timeout`` are per socket operation, not per answer, so a
store that sends one byte just inside each of them defeats them; the bounds here are
per answer and are enforced by :mod:`.transport`, which closes the connection of a
request that passes its deadline or falls below its rate.

Bytes:

* a GET body: exactly the bytes asked for (the range), never one more, whatever the
  store sends or announces (:func:`body_bytes`);
* a listing page: :data:`MAX_PAGE_BYTES`; a whole listing: :data:`MAX_LIST_BYTES`,
  :data:`MAX_LIST_KEYS` entries (keys and common prefixes) and :data:`MAX_LIST_PAGES`
  requests, of which at most :data:`MAX_EMPTY_PAGES` in a row may be empty;
* an error document: :data:`MAX_ERROR_BYTES` (more is dropped; the status decides);
* a string from the store (an error code, a message, a key) quoted in a log line, an
  error or a label: :data:`~weightd.server.base.errors.ECHO_CHARS` characters,
  escaped (:func:`~weightd.server.base.errors.echo`).

Time:

* a request without a body to stream (a listing page, a HEAD): ``request_seconds``,
  from the first byte sent to the last byte of the answer, headers included;
* a whole listing: ``list_seconds``;
* a ranged GET: a minimum rate with a grace window (:func:`too_slow`): after
  ``rate_grace_seconds`` it must have delivered ``min_bytes_per_second`` for every
  second past the grace, so it ends at the latest ``grace + size / min_rate`` after it
  was sent; waiting for the daemon's own ``--s3-max-bytes-per-second`` throttle does not
  count against the store.

The values that are settings are in ``[s3]`` (``config/schema.py``); the others are
constants here, sized far above anything a model directory needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: Entries (keys and common prefixes) one listing may hold: a model directory holds
#: tens of files; a prefix with more is not one.
MAX_LIST_KEYS: Final = 10_000
#: Entries asked for per page (S3's own maximum); a page with more is refused.
PAGE_KEYS: Final = 1_000
#: Requests one listing may make (10,000 keys at 100 a page).
MAX_LIST_PAGES: Final = 100
#: Truncated pages in a row that hold no entry: a store answering only those is looping.
MAX_EMPTY_PAGES: Final = 3
#: Bytes of one listing page (1,000 keys of S3's longest, 1 KiB, with their XML: ~1.5 MiB).
MAX_PAGE_BYTES: Final = 4 << 20
#: Bytes of one whole listing.
MAX_LIST_BYTES: Final = 32 << 20
#: Bytes of an error document read (S3's are a few hundred bytes).
MAX_ERROR_BYTES: Final = 64 << 10
#: Bytes of an answer that has no body of its own (HEAD, PUT-less calls).
MAX_SMALL_BYTES: Final = 64 << 10

#: Defaults of the settings (``--s3-min-bytes-per-second`` and friends).
DEFAULT_MIN_BYTES_PER_SECOND: Final = 64 << 10
DEFAULT_RATE_GRACE_SECONDS: Final = 30.0
DEFAULT_REQUEST_SECONDS: Final = 60.0
DEFAULT_LIST_SECONDS: Final = 120.0


@dataclass(frozen=True)
class StoreBounds:
    """The bounds that are settings (see the module docstring for each)."""

    #: A ranged GET slower than this, past the grace window, is ended.
    min_bytes_per_second: int = DEFAULT_MIN_BYTES_PER_SECOND
    #: Seconds a GET may take before its rate is judged (connection set-up, first byte).
    rate_grace_seconds: float = DEFAULT_RATE_GRACE_SECONDS
    #: Seconds a listing page or a HEAD may take, headers and body together.
    request_seconds: float = DEFAULT_REQUEST_SECONDS
    #: Seconds a whole listing may take, every page together.
    list_seconds: float = DEFAULT_LIST_SECONDS

    def range_seconds(self, size: int) -> float:
        """The latest a GET of ``size`` bytes may end (pure): grace + size / rate."""
        return self.rate_grace_seconds + size / self.min_bytes_per_second

    def too_slow(self, elapsed: float, received: int) -> bool:
        """True when a GET ``elapsed`` seconds old (throttle waits excluded) that has
        ``received`` bytes is below the minimum rate past the grace window (pure)."""
        past = elapsed - self.rate_grace_seconds
        return past > 0 and received < self.min_bytes_per_second * past


def body_bytes(start: int, end: int) -> int:
    """Bytes a GET of ``[start, end)`` may deliver: what was asked (pure)."""
    return end - start
