"""The bounds of :mod:`.bounds`, enforced under boto3: one choke point for every byte
and every second of every answer from the store.

boto3 keeps doing what it does well (credentials, signing, retries with backoff,
TLS, proxies); what it cannot do is bound an answer as a whole. Its timeouts are per
socket operation, it reads a listing page or an error document whole into memory
before parsing it, and a body is read for as long as the store sends. So the client's
HTTP session is fitted (:meth:`BoundedTransport.install`) with:

* a **budget** per request (:class:`Budget`): a deadline, a byte cap, optionally the
  minimum rate, and a cancel flag. The calling thread opens it around the SDK call
  (:meth:`BoundedTransport.budget`); every connection that carries the request
  registers with it as the request is sent;
* a **watchdog** thread that, a few times a second, ends every budget that passed its
  deadline, fell below its rate or was cancelled, by shutting its connections down:
  whatever read is blocked (headers dripping in, a body dripping in, a stalled
  socket) returns at once, and the call fails with the budget's own typed error,
  never retried by the SDK;
* **bounded reads**: an answer without a streamed body (a listing page, a HEAD, any
  error document) is read here, under its cap, before botocore sees it; a streamed
  body (a ranged GET) is wrapped so that it can never deliver more than was asked and
  counts every byte towards the rate as it arrives.

The only SDK internals touched are the endpoint's HTTP session and its connection
pool classes (botocore's own ``URLLib3Session``, ``AWSHTTP(S)ConnectionPool``); if a
botocore release moves them, :meth:`~BoundedTransport.install` refuses to start
rather than run unbounded.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Final, Protocol

from ..base.errors import (
    ObjectStoreError,
    ObjectStoreProtocolError,
    ObjectStoreTooSlow,
    ObjectTruncated,
    SourceCancelled,
    UsageError,
)
from .bounds import MAX_ERROR_BYTES, StoreBounds

#: Seconds between two looks of the watchdog at the open budgets.
TICK_SECONDS: Final = 0.1
#: Most bytes one read of an answer gathers before they are counted.
_READ1: Final = 1 << 20
#: Fewest: a body's piece is never cut below this for the sake of the rate's accounting.
_MIN_PIECE: Final = 64 << 10

_current = threading.local()


class Flag(Protocol):
    """What cancels a budget: a ``threading.Event``, or either of two."""

    def is_set(self) -> bool: ...


class Budget:
    """One request's bounds while it runs (see the module docstring).

    ``received`` and ``paused`` are written by the reading thread, ``failure`` by the
    watchdog; a failure is final.
    """

    def __init__(
        self,
        uri: str,
        what: str,
        *,
        seconds: float,
        max_bytes: int,
        rate: StoreBounds | None = None,
        cancel: Flag | None = None,
    ) -> None:
        self.uri = uri
        self.what = what
        self.seconds = seconds
        self.started = time.monotonic()
        self.deadline = self.started + seconds
        self.max_bytes = max_bytes
        self.rate = rate
        self.cancel = cancel
        self.received = 0
        self.paused = 0.0
        self.failure: ObjectStoreError | None = None
        self._lock = threading.Lock()
        self._conns: list[Any] = []
        #: Bytes a body read gathers before it counts them (:class:`BoundedBody`): the
        #: count may lag the socket by this much, so it is at most half of what the rate
        #: asks within the grace window, and a store that keeps the minimum rate is never
        #: taken for a slower one.
        self.piece_bytes = _READ1
        if rate is not None:
            half = int(rate.min_bytes_per_second * rate.rate_grace_seconds / 2)
            self.piece_bytes = max(_MIN_PIECE, min(_READ1, half))

    def pause(self, seconds: float) -> None:
        """``seconds`` spent waiting for the daemon's own throttle: not the store's time."""
        if seconds > 0:
            self.paused += seconds
            self.deadline += seconds

    def verdict(self, now: float) -> ObjectStoreError | None:
        """Why this budget must end now, or None (pure but for the clock passed in)."""
        if self.cancel is not None and self.cancel.is_set():
            return SourceCancelled(self.uri, f"{self.what} cancelled (a deadline or shutdown)")
        elapsed = now - self.started - self.paused
        if self.rate is not None and self.rate.too_slow(elapsed, self.received):
            r = self.rate
            return ObjectStoreTooSlow(
                self.uri,
                f"{self.what}: {self.received} bytes in {elapsed:.1f} s, below the minimum of "
                f"{r.min_bytes_per_second} bytes/s after a {r.rate_grace_seconds:g} s grace "
                "(--s3-min-bytes-per-second); the connection was closed",
            )
        if now > self.deadline:
            return ObjectStoreTooSlow(
                self.uri,
                f"{self.what}: no complete answer within {self.seconds:g} s; "
                "the connection was closed",
            )
        return None

    def check(self) -> None:
        """Raise the failure, if the watchdog ended this budget."""
        if self.failure is not None:
            raise self.failure

    def attach(self, conn: Any) -> None:
        """``conn`` carries this request now (called as the request is sent)."""
        conn.weightd_budget = self
        with self._lock:
            self._conns.append(conn)
            failed = self.failure is not None
        if failed:
            _shut(conn, self)

    def end(self, failure: ObjectStoreError) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
            conns = list(self._conns)
        for conn in conns:
            _shut(conn, self)

    def count(self, n: int) -> None:
        self.received += n
        if self.received > self.max_bytes:
            raise _over_cap(self)


def _over_cap(budget: Budget) -> ObjectStoreError:
    """The error for an answer longer than its budget allows."""
    if budget.rate is not None:  # a body: more than the range asked for
        return ObjectTruncated(
            budget.uri,
            f"{budget.what} sent more than the {budget.max_bytes} bytes asked for; "
            "nothing past them was read",
        )
    return ObjectStoreProtocolError(
        budget.uri,
        f"{budget.what}: an answer over the {budget.max_bytes}-byte bound; "
        "nothing past it was read",
    )


def _shut(conn: Any, budget: Budget) -> None:
    """Shut ``conn``'s socket down if it still carries ``budget`` (a pooled connection
    may already carry another request, which must not be touched)."""
    if getattr(conn, "weightd_budget", None) is not budget:
        return
    sock = getattr(conn, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Watchdog:
    """One thread ending the budgets that must end (started on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[Budget] = set()
        self._thread: threading.Thread | None = None
        self.closed = False

    def add(self, budget: Budget) -> None:
        with self._lock:
            self._open.add(budget)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="weightd-s3-watchdog", daemon=True
                )
                self._thread.start()

    def remove(self, budget: Budget) -> None:
        with self._lock:
            self._open.discard(budget)

    def _run(self) -> None:
        while True:
            time.sleep(TICK_SECONDS)
            now = time.monotonic()
            with self._lock:
                budgets = list(self._open)
            for b in budgets:
                failure = b.verdict(now)
                if failure is not None:
                    b.end(failure)


class BoundedBody:
    """A GET's body as botocore's ``StreamingBody`` reads it: never more than the budget's
    cap, every byte counted towards the rate within ``Budget.piece_bytes`` of its
    arrival."""

    def __init__(self, raw: Any, budget: Budget) -> None:
        self._raw = raw
        self._budget = budget

    def read(self, amt: int | None = None) -> bytes:
        """At most ``amt`` bytes: a piece of up to the budget's piece size, gathered by
        the HTTP layer's own loop (not one Python round trip per ``recv``: a reader that
        keeps up with a fast store gets each ``recv`` in tens of KiB), then counted; short
        at the end of the body, or when the watchdog closed the connection."""
        if amt is None or amt < 0:  # everything: gathered, under the same cap
            out = bytearray()
            while part := self.read(_READ1):
                out += part
            return bytes(out)
        self._budget.check()
        piece: bytes = self._raw.read(min(self._budget.piece_bytes, amt))
        self._budget.check()
        self._budget.count(len(piece))
        return piece

    def readinto(self, b: Any) -> int:
        """As :meth:`read`, straight into ``b`` (the download's own buffer, reused): no
        buffer made, filled and copied per piece. Through the HTTP response the body
        came on (the one urllib3 wraps), whose length bookkeeping ends the body; once it
        is whole the connection goes back to the pool, as urllib3 would return it."""
        view = memoryview(b).cast("B")
        want = min(self._budget.piece_bytes, len(view))
        self._budget.check()
        response = getattr(self._raw, "_fp", None)
        if not isinstance(response, http.client.HTTPResponse):  # another HTTP layer
            piece = self._raw.read(want)
            n = len(piece)
            view[:n] = piece
        else:
            try:
                n = response.readinto(view[:want])
            except (OSError, http.client.HTTPException) as exc:
                self._budget.check()  # the watchdog closed it: its reason, not this one
                from urllib3.exceptions import ProtocolError

                # What urllib3 raises for a broken body; botocore and classify() map it.
                raise ProtocolError(f"Connection broken: {exc!r}", exc) from None
            if n and response.isclosed():
                self._raw.release_conn()
        self._budget.check()
        self._budget.count(n)
        return n

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()

    def release_conn(self) -> None:
        self._raw.release_conn()

    def stream(self, amt: int = _READ1, decode_content: bool | None = None) -> Iterator[bytes]:
        """The body in pieces, under the same bounds (never the raw, unbounded stream)."""
        while piece := self.read(amt):
            yield piece

    def __getattr__(self, name: str) -> Any:  # headers, status, ... of the raw response
        return getattr(self._raw, name)


def _read_capped(raw: Any, cap: int, budget: Budget) -> bytes | None:
    """The whole answer if it fits ``cap`` bytes, else None (reading stops there)."""
    out = bytearray()
    while True:
        budget.check()
        piece = raw.read1(min(_READ1, cap + 1 - len(out)))
        budget.check()
        if not piece:
            return bytes(out)
        budget.received += len(piece)
        out += piece
        if len(out) > cap:
            return None


def _pool_classes() -> dict[str, type[Any]]:
    from botocore.awsrequest import (
        AWSHTTPConnection,
        AWSHTTPConnectionPool,
        AWSHTTPSConnection,
        AWSHTTPSConnectionPool,
    )

    class Connection(AWSHTTPConnection):  # type: ignore[misc]
        def request(self, *args: Any, **kwargs: Any) -> Any:
            budget = getattr(_current, "budget", None)
            if budget is not None:
                budget.attach(self)
            return super().request(*args, **kwargs)

    class TlsConnection(AWSHTTPSConnection):  # type: ignore[misc]
        def request(self, *args: Any, **kwargs: Any) -> Any:
            budget = getattr(_current, "budget", None)
            if budget is not None:
                budget.attach(self)
            return super().request(*args, **kwargs)

    class Pool(AWSHTTPConnectionPool):  # type: ignore[misc]
        ConnectionCls = Connection

    class TlsPool(AWSHTTPSConnectionPool):  # type: ignore[misc]
        ConnectionCls = TlsConnection

    return {"http": Pool, "https": TlsPool}


class BoundedTransport:
    """Budgets, the watchdog and the fitted HTTP session of one S3 client."""

    def __init__(self, bounds: StoreBounds) -> None:
        self.bounds = bounds
        self._watchdog = _Watchdog()
        #: Set by :meth:`close`: every budget open or opened later is cancelled.
        self.closing = threading.Event()

    def install(self, client: Any) -> None:
        """Fit ``client``'s HTTP session with the budgets (before its first request)."""
        from botocore.httpsession import URLLib3Session

        endpoint = getattr(client, "_endpoint", None)
        session = getattr(endpoint, "http_session", None)
        manager = getattr(session, "_manager", None)
        if not isinstance(session, URLLib3Session) or manager is None:
            raise UsageError(
                "this botocore's HTTP session is not the one weightd bounds (URLLib3Session); "
                "install a boto3/botocore release weightd supports"
            )
        pools = _pool_classes()
        session._pool_classes_by_scheme = pools
        manager.pool_classes_by_scheme = pools
        inner = session.send

        def send(request: Any) -> Any:
            return self._send(inner, request)

        session.send = send

    def _send(self, inner: Any, request: Any) -> Any:
        budget: Budget | None = getattr(_current, "budget", None)
        if budget is None:  # only requests under a budget reach the store
            raise UsageError("a request to the object store outside a budget (a weightd bug)")
        budget.check()
        streamed = request.stream_output
        request.stream_output = True  # the body is read here, under its bounds
        try:
            response = inner(request)
        except Exception:
            budget.check()  # the watchdog closed it: say why, and do not retry
            raise
        finally:
            request.stream_output = streamed  # a retry sends the same request again
        if streamed and response.status_code < 300:
            response.raw = BoundedBody(response.raw, budget)
            return response
        cap = budget.max_bytes if response.status_code < 300 else MAX_ERROR_BYTES
        try:
            data = _read_capped(response.raw, cap, budget)
        except Exception:
            budget.check()
            raise
        if data is None:
            response.raw.close()
            if response.status_code < 300:
                raise _over_cap(budget)
            data = b""  # an error document over its bound: the status says enough
        response._content = data
        return response

    @contextlib.contextmanager
    def budget(
        self,
        uri: str,
        what: str,
        *,
        seconds: float,
        max_bytes: int,
        rate: bool = False,
        cancel: threading.Event | None = None,
    ) -> Iterator[Budget]:
        """A budget for the requests this thread makes inside the block."""
        b = self.open(uri, what, seconds=seconds, max_bytes=max_bytes, rate=rate, cancel=cancel)
        try:
            yield b
        finally:
            self.close_budget(b)

    def open(
        self,
        uri: str,
        what: str,
        *,
        seconds: float,
        max_bytes: int,
        rate: bool = False,
        cancel: threading.Event | None = None,
    ) -> Budget:
        """Open a budget (the caller closes it with :meth:`close_budget`); the SDK calls
        this thread makes until :meth:`detach` run under it."""
        flag: Flag = _Either(cancel, self.closing) if cancel is not None else self.closing
        b = Budget(
            uri,
            what,
            seconds=seconds,
            max_bytes=max_bytes,
            rate=self.bounds if rate else None,
            cancel=flag,
        )
        self._watchdog.add(b)
        _current.budget = b
        return b

    @staticmethod
    def detach() -> None:
        """Requests this thread makes from now on are under no budget (refused)."""
        _current.budget = None

    def close_budget(self, b: Budget) -> None:
        if getattr(_current, "budget", None) is b:
            _current.budget = None
        self._watchdog.remove(b)

    def close(self) -> None:
        """Cancel every budget open now or later (shutdown): blocked reads end at once."""
        self.closing.set()


class _Either:
    """Set when either flag is (a request's own cancel, or the transport closing)."""

    def __init__(self, a: threading.Event, b: threading.Event) -> None:
        self._a, self._b = a, b

    def is_set(self) -> bool:
        return self._a.is_set() or self._b.is_set()
