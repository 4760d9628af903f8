"""The metrics listener: a bounded HTTP/1.1 server for ``GET /metrics``.

Why not ``prometheus_client.start_http_server``: it runs a thread per connection with
no timeout, so 1,500 idle connections held 1,500 threads and descriptors. Here:

* **one selector thread** accepts and reads request heads, never blocking on a peer;
* **a connection cap** (:data:`MAX_CONNECTIONS`): at the cap a new connection takes
  the place of the one that has been sending its request head longest (a scraper
  sends it at once, so idle clients are the ones dropped), or is closed at once when
  every slot is answering; descriptors stay bounded whatever clients do;
* **a deadline per connection** (:data:`REQUEST_SECONDS` from accept to the end of
  the request head, and again to send the answer): an idle or dripping client is
  dropped; a head over :data:`MAX_HEAD_BYTES` is refused (431);
* **a fixed pool** (:data:`SCRAPE_THREADS`) renders scrapes, whose queue cannot
  outgrow the connection cap;
* one request per connection (``Connection: close``): a scraper reconnects each time.

The body is what ``prometheus_client`` itself renders for the request's ``Accept``
header (text or OpenMetrics), gzipped when asked for, as its own server does.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger("weightd.metrics")

MAX_CONNECTIONS: Final = 32
REQUEST_SECONDS: Final = 10.0
MAX_HEAD_BYTES: Final = 8 << 10
SCRAPE_THREADS: Final = 2
_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
}


@dataclass
class _Reading:
    deadline: float
    head: bytearray = field(default_factory=bytearray)


def parse_head(head: bytes) -> tuple[str, str, dict[str, str]] | None:
    """Method, path (query dropped) and lower-cased headers of a request head (pure)."""
    try:
        text = head.decode("latin-1")
        line, *rest = text.split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        return None
    if not version.startswith("HTTP/"):
        return None
    headers = {}
    for item in rest:
        name, sep, value = item.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, target.split("?", 1)[0], headers


class MetricsHttpServer:
    """Serves ``registry`` on ``host:port`` (port 0 picks one) until :meth:`close`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        request_seconds: float = REQUEST_SECONDS,
    ) -> None:
        self.registry = registry
        self.max_connections = max_connections
        self.request_seconds = request_seconds
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.host = host
        self.port = int(listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._reading: dict[socket.socket, _Reading] = {}
        self._lock = threading.Lock()
        self._open = 0
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(SCRAPE_THREADS, thread_name_prefix="weightd-metrics")
        self._thread = threading.Thread(target=self._loop, name="weightd-metrics", daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return self._open

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=True)
        for conn in list(self._reading):
            self._drop(conn)
        self._selector.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    # --- the selector thread ----------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            deadlines = [r.deadline for r in self._reading.values()]
            wait = max(0.0, min(deadlines) - now) if deadlines else None
            for key, _ in self._selector.select(wait):
                if key.data == "accept":
                    self._accept()
                elif key.data == "read":
                    self._read(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for conn, reading in list(self._reading.items()):
                if reading.deadline <= now:
                    self._drop(conn)  # idle or dripping: its time is up

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("metrics listener: accept failed: %s", exc)
                return
            with self._lock:
                full = self._open >= self.max_connections
            if full and self._reading:
                # Make room by dropping the connection that has been sending its head
                # longest: a scraper sends it at once, so idle clients go first.
                self._drop(min(self._reading, key=lambda c: self._reading[c].deadline))
                full = False
            if full:
                conn.close()  # every slot is answering a scrape: a moment, never a thread
                continue
            with self._lock:
                self._open += 1
            conn.setblocking(False)
            self._reading[conn] = _Reading(time.monotonic() + self.request_seconds)
            self._selector.register(conn, selectors.EVENT_READ, "read")

    def _read(self, conn: socket.socket) -> None:
        reading = self._reading[conn]
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        reading.head += data
        end = reading.head.find(b"\r\n\r\n")
        if end < 0 and len(reading.head) <= MAX_HEAD_BYTES:
            return
        self._selector.unregister(conn)
        del self._reading[conn]
        head = bytes(reading.head[:end]) if 0 <= end <= MAX_HEAD_BYTES else None
        self._pool.submit(self._answer, conn, head)

    def _drop(self, conn: socket.socket) -> None:
        if self._reading.pop(conn, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn)
        self._finish(conn)

    def _finish(self, conn: socket.socket) -> None:
        conn.close()
        with self._lock:
            self._open -= 1

    # --- the scrape pool ----------------------------------------------------------

    def _answer(self, conn: socket.socket, head: bytes | None) -> None:
        try:
            status, headers, body = self._render(head)
            lines = [f"HTTP/1.1 {status} {_REASONS[status]}"]
            lines += [f"{k}: {v}" for k, v in headers]
            lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
            conn.setblocking(True)
            conn.settimeout(self.request_seconds)  # the whole answer (sendall's total)
            conn.sendall("\r\n".join(lines).encode("latin-1") + body)
        except OSError as exc:
            log.debug("metrics connection ended early: %s", exc)
        except Exception:
            log.exception("metrics scrape failed")
        finally:
            self._finish(conn)

    def _render(self, head: bytes | None) -> tuple[int, list[tuple[str, str]], bytes]:
        if head is None:
            return 431, [], b"request head too large\n"
        parsed = parse_head(head)
        if parsed is None:
            return 400, [], b"bad request\n"
        method, path, headers = parsed
        if method != "GET":
            return 405, [("Allow", "GET")], b"only GET\n"
        if path not in ("/metrics", "/"):
            return 404, [], b"metrics are at /metrics\n"
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(self.registry)
        out = [("Content-Type", content_type)]
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body)
            out.append(("Content-Encoding", "gzip"))
        return 200, out, body
