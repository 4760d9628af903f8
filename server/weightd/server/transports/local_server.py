"""The side socket: a Unix stream socket next to the gRPC one, passing packs' descriptors.

Why a second socket: gRPC cannot pass file descriptors, and a lease must end when
its holder dies, which a connection does by itself (the kernel closes it). So each
connection carries one exchange (hello, request, answer with the memfd as
``SCM_RIGHTS``) and at most one lease, held until the client closes the connection
or its process exits. A thread per connection blocks in ``recv`` for that moment.

Bounds, so no client behaviour holds the daemon's memory or slots for long:

* a client has :data:`REQUEST_TIMEOUT_SECONDS` from connecting to deliver its whole
  request (a deadline for the exchange, not a timeout per read: one byte every few
  seconds does not keep a slot);
* a request frame is at most :data:`~weightd.common.frames.MAX_REQUEST_FRAME_BYTES`
  (1 MiB, gRPC's own request limit), and at most :data:`MAX_PENDING` connections
  may be waiting for theirs at once, so requests in flight hold at most
  ``MAX_PENDING`` MiB whatever clients send; names inside are bounded by
  :func:`~weightd.server.base.bounds.check_fields`;
* connections beyond ``max_connections``, beyond ``max_per_user`` from one other user
  (the peer's uid, from ``SO_PEERCRED``: a process cannot forge it, unlike its pid,
  which a fork renews; the daemon's own user is bounded by the total only), beyond
  ``MAX_PENDING`` still waiting, or beyond half of those from one other user, get a
  hello whose ``refused`` carries RESOURCE_EXHAUSTED and its reason, where the client
  reads the hello, so it reports the daemon's reason and not a broken pipe.

The socket is created beside the gRPC socket, in its 0700 directory, while the
daemon holds the gRPC socket's ``flock``, so a stale side socket from a dead daemon
is safe to replace and a live one is never stolen.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Final

from google.protobuf.message import DecodeError

from weightd.common.frames import MAX_REQUEST_FRAME_BYTES, FrameError, recv_frame, send_frame
from weightd.v1 import local_pb2 as lpb

from ..base.errors import Code, ListenError, SideChannelFull
from ..telemetry.metrics import Metrics
from .local_service import PackService, local_error
from .options import LOCAL_SOCKET_SUFFIX, LocalConfig

log = logging.getLogger("weightd.local")

#: A client has this long after connecting to send its whole request.
REQUEST_TIMEOUT_SECONDS: Final = 30.0
#: Connections that may be waiting for their request at once.
MAX_PENDING: Final = 64
_REAP_INTERVAL_MAX: Final = 5.0


def _peer_pid(conn: socket.socket) -> int:
    return _peer_creds(conn)[0]


def _peer_creds(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end (the kernel's word)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return int(pid), int(uid)


#: The ``service`` label of side-channel requests in ``weightd_rpcs_total``.
LOCAL_SERVICE: Final = "weightd.v1.Local"
_METHODS: Final = {"acquire": "AcquirePack", "attach": "AttachPack", "stats": "PackStats"}


class LocalObserver:
    """The side channel in the daemon's RPC metrics, as the gRPC edge's interceptor counts
    Fetch: every answer in ``weightd_rpcs_total{service="weightd.v1.Local"}`` by request
    and code; each model pack granted in ``weightd_served_bytes_total`` (the granted
    tensors' bytes) and ``weightd_fetch_duration_seconds``, with ``transport="shm"``
    (``"cuda_ipc"`` for a GPU pack). Shared memory is the default on one host, so
    without this most fetches never showed. ``resolve`` maps a model name to its
    operator-configured label (None: not counted by model: a bounded label set)."""

    def __init__(self, metrics: Metrics, resolve: Callable[[str], str | None]) -> None:
        self._metrics = metrics
        self._resolve = resolve

    def answered(
        self, request: lpb.LocalRequest, response: lpb.LocalResponse, seconds: float
    ) -> None:
        method = _METHODS.get(request.WhichOneof("request") or "", "Unknown")
        code = "OK"
        if response.WhichOneof("response") == "error":
            try:
                code = Code(response.error.code).name
            except ValueError:
                code = "UNKNOWN"
        self._metrics.rpcs.labels(LOCAL_SERVICE, method, code).inc()
        if response.WhichOneof("response") != "grant" or response.grant.HasField("adapter"):
            return
        grant = response.grant
        transport = "cuda_ipc" if grant.placement == lpb.PLACEMENT_CUDA else "shm"
        sent = sum(e.nbytes for e in grant.entries)
        model = self._resolve(grant.model)
        if sent and model is not None:
            self._metrics.served_bytes.labels(transport, model).inc(sent)
        self._metrics.fetch_seconds.labels(transport).observe(seconds)


class LocalServer:
    def __init__(
        self,
        path: str,
        service: PackService,
        max_connections: int,
        *,
        request_timeout: float = REQUEST_TIMEOUT_SECONDS,
        max_pending: int = MAX_PENDING,
        socket_mode: int = 0o600,
        max_per_user: int = 0,
        observer: LocalObserver | None = None,
    ) -> None:
        self.path = path
        self.service = service
        self.max_connections = max_connections
        self.max_per_user = max_per_user or max(1, max_connections // 2)
        self._own_uid = os.geteuid()
        self.request_timeout = request_timeout
        self.max_pending = max_pending
        self.socket_mode = socket_mode
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._pending = 0
        #: Connections and those still sending their request, per peer uid.
        self._per_user: Counter[int] = Counter()
        self._pending_per_user: Counter[int] = Counter()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        #: Counts and times each answer in the daemon's metrics (None: not counted).
        self.observer = observer
        service.connections = self._count

    def _count(self) -> int:
        with self._lock:
            return len(self._conns)

    def start(self) -> None:
        """Bind and start serving. The caller holds the gRPC socket's lock."""
        listener = listen_unix(self.path, self.socket_mode, 128, "side socket")
        self._listener = listener
        interval = min(_REAP_INTERVAL_MAX, max(0.05, self.service.host.ttl_seconds / 4))
        for target, name, args in (
            (self._accept_loop, "weightd-local-accept", (listener,)),
            (self._reap_loop, "weightd-local-reap", (interval,)),
        ):
            t = threading.Thread(target=target, name=name, args=args, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("side socket for shared-memory packs on %s", self.path)

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed by close()
            deadline = time.monotonic() + self.request_timeout
            try:
                uid = _peer_creds(conn)[1]
            except OSError:
                conn.close()
                continue
            with self._lock:
                full = self._full(uid)
                if full is None:
                    self._conns.add(conn)
                    self._pending += 1
                    self._per_user[uid] += 1
                    self._pending_per_user[uid] += 1
            if full is not None:
                self._refuse(conn, full)
                continue
            # Not threading.Thread: its start() waits until the new thread runs, so on a
            # busy host each accept waited for a core before the next connection was
            # taken (four TP ranks on two cores: the last rank waited measurably longer).
            # Nothing joins these threads: a connection's end ends its thread.
            try:
                _thread.start_new_thread(self._serve_logged, (conn, deadline, uid))
            except RuntimeError as exc:  # the host's thread limit: refuse this one, go on
                with self._lock:
                    self._conns.discard(conn)
                    self._pending -= 1
                    self._per_user[uid] -= 1
                    self._pending_per_user[uid] -= 1
                self._refuse(conn, f"the daemon cannot start a thread for the connection: {exc}")

    def _full(self, uid: int) -> str | None:
        """Why a new connection from user ``uid`` cannot be taken now, or None (called
        under the lock). Per user first: another user's connections (a member of the
        daemon's group, with ``--socket-group-access``) never take every slot from the
        daemon's own user, whose engines are bounded by the total alone."""
        other = uid != self._own_uid
        if other and self._per_user[uid] >= self.max_per_user:
            return (
                f"uid {uid} holds {self._per_user[uid]} side-channel connections, the most "
                "one user may (local.side_max_connections_per_user)"
            )
        if len(self._conns) >= self.max_connections:
            return f"the daemon holds {self.max_connections} side-channel connections already"
        if other and self._pending_per_user[uid] >= max(1, self.max_pending // 2):
            return (
                f"uid {uid} has {self._pending_per_user[uid]} side-channel connections still "
                "sending their request; try again shortly"
            )
        if self._pending >= self.max_pending:
            return (
                f"{self.max_pending} side-channel connections are still sending their "
                "request; try again shortly"
            )
        return None

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        """Answer in the hello's place, so the client reads the reason where it looks."""
        hello = lpb.LocalHello(refused=local_error(SideChannelFull(reason), "connect"))
        with contextlib.suppress(OSError, FrameError):
            conn.settimeout(1.0)
            send_frame(conn, hello.SerializeToString())
            conn.shutdown(socket.SHUT_WR)
        conn.close()

    def _serve_logged(self, conn: socket.socket, deadline: float, uid: int) -> None:
        """:meth:`_serve`, its unexpected failure logged (a bare thread only prints it)."""
        try:
            self._serve(conn, deadline, uid)
        except Exception:
            log.exception("side-channel connection failed")

    def _serve(self, conn: socket.socket, deadline: float, uid: int) -> None:
        lease = None
        pid = 0
        pending = True
        try:
            pid = _peer_pid(conn)
            conn.settimeout(max(0.0, deadline - time.monotonic()))
            send_frame(conn, self.service.hello().SerializeToString())
            got = recv_frame(conn, max_bytes=MAX_REQUEST_FRAME_BYTES, deadline=deadline)
            with self._lock:
                self._pending -= 1
                self._pending_per_user[uid] -= 1
                pending = False
            if got is None:
                return
            try:
                request = lpb.LocalRequest.FromString(got[0])
            except DecodeError as exc:
                raise FrameError(f"undecodable request: {exc}") from None
            del got
            started = time.monotonic()
            outcome = self.service.handle(request)
            lease = outcome.lease
            if self.observer is not None:  # before the answer: a client reads the metrics next
                self.observer.answered(request, outcome.response, time.monotonic() - started)
            conn.settimeout(self.request_timeout)  # the whole answer (sendall), however big
            send_frame(conn, outcome.response.SerializeToString(), outcome.fds)
            if lease is None:
                return
            log.debug("pid %d holds a lease on pack %d", pid, lease.pack_id)
            conn.settimeout(None)
            if conn.recv(1):
                log.warning("pid %d sent data while holding a lease; lease ended", pid)
        except (OSError, FrameError) as exc:
            log.info("side-channel connection from pid %d ended: %s", pid, exc)
        finally:
            if lease is not None:
                lease.release()
                log.debug("pid %d released pack %d", pid, lease.pack_id)
            with self._lock:
                self._conns.discard(conn)
                self._per_user[uid] -= 1
                if pending:
                    self._pending -= 1
                    self._pending_per_user[uid] -= 1
                self._per_user += Counter()  # drops users with no connection left
                self._pending_per_user += Counter()
            conn.close()

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.service.reap()
            except Exception:
                log.exception("freeing expired packs failed")

    def close(self) -> None:
        """Stop accepting, end every connection (and lease), free every pack."""
        self._stop.set()
        with self._lock:
            conns = list(self._conns)
        shut_down(self._listener, self.path, conns)
        for t in self._threads:
            t.join(timeout=5)
        self.service.close()


def start_local_server(
    grpc_socket_path: str,
    service: PackService,
    config: LocalConfig,
    *,
    group: bool = False,
    observer: LocalObserver | None = None,
) -> LocalServer:
    """The side socket for a daemon listening on ``grpc_socket_path``, serving
    ``service``, started (0600, or 0660 with ``group``: the gRPC socket's mode)."""
    server = LocalServer(
        grpc_socket_path + LOCAL_SOCKET_SUFFIX,
        service,
        config.max_connections,
        request_timeout=config.request_seconds,
        socket_mode=0o660 if group else 0o600,
        max_per_user=config.resolved_per_user(),
        observer=observer,
    )
    server.start()
    return server


def shut_down(listener: socket.socket | None, path: str, conns: list[socket.socket]) -> None:
    """Stop accepting on ``listener`` (its socket file removed) and end ``conns``: what
    both side sockets do at close, before they wait for their threads."""
    if listener is not None:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


def listen_unix(path: str, mode: int, backlog: int, what: str) -> socket.socket:
    """A Unix listener at ``path`` with ``mode`` (not the umask's): a socket left there
    by a daemon that died is replaced (the caller holds the lock beside it), anything
    else there is refused. What both side sockets bind."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise ListenError(f"{path} exists and is not a socket; refusing to replace it")
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.bind(path)
        os.chmod(path, mode)
        listener.listen(backlog)
    except OSError as exc:
        listener.close()
        raise ListenError(f"cannot listen on {what} {path}: {exc}") from None
    return listener
