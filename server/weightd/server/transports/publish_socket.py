"""The admin side socket: a trainer on the daemon's host hands over a sealed memfd.

``<admin socket path>.local``, beside the admin socket (see ``local.proto`` for the
exchange). Why this is safe:

* **Only admins reach it.** It is a Unix socket with the admin socket's mode, 0600
  whatever ``--socket-group-access`` says (admin is never shared with the group; the
  worker sockets are), in the admin socket's directory, created while the
  daemon holds that socket's ``flock``; the worker side socket (``<socket>.local``,
  :mod:`.local_server`) has no publish path at all and answers a publish request with
  :class:`~weightd.server.base.errors.AdminOnly`. Where the admin listener is TCP there
  is no such socket: a remote trainer uses the ``PublishTensors`` gRPC stream, under
  the admin listener's mutual TLS and allow-list.
* **Descriptors are bounded and closed on every path.** The size is announced and
  checked against the model's bound *before* any descriptor is accepted; then exactly
  one descriptor is read (``recv_frame(max_fds=1)``: more are closed at once and the
  trainer told why); the one accepted is closed on every failure (:mod:`..weights`'s
  ``Publisher.publish_memory`` takes it over) and, once published, by the version's
  store when the version is dropped.
* **Nobody can change what was hashed.** The memfd must carry ``F_SEAL_SHRINK |
  F_SEAL_GROW | F_SEAL_WRITE`` (checked with ``F_GET_SEALS``): the trainer keeps its
  descriptor but can no longer write, grow or truncate it.
* **Bounded in time and number.** :data:`MAX_CONNECTIONS` connections at once; each has
  ``request_seconds`` to send its requests (a deadline for all of them, not per read).
  The work itself is one publish per model at a time (the model's reload lock).
* **A trainer that dies publishes nothing.** The connection is checked just before the
  commit (:func:`peer_gone`): closed means the version is discarded, its memfd closed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from typing import Final

from google.protobuf.message import DecodeError

from weightd.common.frames import MAX_REQUEST_FRAME_BYTES, FrameError, recv_frame, send_frame
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

from ..base.bounds import check_fields
from ..base.errors import (
    LocalProtocolError,
    PublishAborted,
    PublishRefused,
    SideChannelFull,
)
from ..weights.models import Published, Publisher, VersionInfo
from .local_server import listen_unix, shut_down
from .local_service import local_error
from .options import LOCAL_SOCKET_SUFFIX

log = logging.getLogger("weightd.publish")

#: Publishing connections served at once (admins only; each may hold a big memfd).
MAX_CONNECTIONS: Final = 4
#: A trainer has this long after connecting to send its requests (not the publish).
REQUEST_SECONDS: Final = 60.0
PROTOCOL_VERSION: Final = 1


def peer_gone(conn: socket.socket) -> bool:
    """The other end closed the connection (or sent bytes it had no reason to send)."""
    ready = select.poll()
    ready.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLRDHUP)
    events = ready.poll(0)
    return any(
        ev & (select.POLLHUP | select.POLLERR | select.POLLRDHUP | select.POLLIN)
        for _, ev in events
    )


def _published_pb(p: Published) -> pb.PublishResponse:
    """The reply, as the Publish RPC's (``rpc/versions.py`` encodes the same for gRPC)."""
    info = VersionInfo.of(p.model)
    return pb.PublishResponse(
        version=pb.VersionInfo(
            model=info.model,
            version=info.version,
            model_fingerprint=info.fingerprint,
            total_bytes=info.total_bytes,
            num_tensors=info.num_tensors,
            architecture=info.architecture,
            source=info.source,
        ),
        verify_seconds=p.verify_seconds,
        prepare_seconds=p.prepared.seconds,
        packs_built=p.prepared.packs_built,
    )


class PublishSocket:
    """Serves ``path``: one publish from memory per connection, through ``publisher``."""

    def __init__(
        self,
        path: str,
        publisher: Publisher,
        *,
        socket_mode: int = 0o600,
        request_seconds: float = REQUEST_SECONDS,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.path = path
        self.publisher = publisher
        self.socket_mode = socket_mode
        self.request_seconds = request_seconds
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.boot_id = os.urandom(8).hex()

    def start(self) -> None:
        """Bind and serve. The caller holds the admin socket's lock."""
        listener = listen_unix(self.path, self.socket_mode, 16, "admin side socket")
        self._listener = listener
        self._thread = threading.Thread(
            target=self._accept_loop, args=(listener,), name="weightd-publish-accept", daemon=True
        )
        self._thread.start()
        log.info("admin side socket for publishing from memory on %s", self.path)

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._answer_hello(conn, f"{self.max_connections} publishes are in progress")
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="weightd-publish", daemon=True
            ).start()

    def _answer_hello(self, conn: socket.socket, refused: str = "") -> None:
        hello = lpb.LocalHello(protocol_version=PROTOCOL_VERSION, boot_id=self.boot_id)
        hello.pid = os.getpid()
        if refused:
            hello.refused.CopyFrom(local_error(SideChannelFull(refused), "connect"))
        with contextlib.suppress(OSError, FrameError):
            conn.settimeout(1.0)
            send_frame(conn, hello.SerializeToString())

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._exchange(conn)
        except (OSError, FrameError) as exc:
            log.info("publishing connection ended: %s", exc)
        except Exception:
            log.exception("publishing connection failed")
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _request(
        self, conn: socket.socket, deadline: float, max_fds: int
    ) -> tuple[lpb.LocalRequest, list[int]]:
        got = recv_frame(conn, max_fds, max_bytes=MAX_REQUEST_FRAME_BYTES, deadline=deadline)
        if got is None:
            raise FrameError("the trainer closed the connection before its request")
        payload, fds = got
        try:
            try:
                request = lpb.LocalRequest.FromString(payload)
            except DecodeError as exc:
                raise LocalProtocolError(f"undecodable request: {exc}") from None
            check_fields(request)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return request, fds

    def _exchange(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.request_seconds
        self._answer_hello(conn)
        try:
            request, _ = self._request(conn, deadline, 0)
            if request.WhichOneof("request") != "publish":
                raise LocalProtocolError(
                    "the admin side socket takes a publish request only, got "
                    f"{request.WhichOneof('request') or '(empty)'}"
                )
            model, limit = self.publisher.memory_limit(request.publish.model)
            announced = request.publish.nbytes
            if announced > limit:
                raise PublishRefused(
                    f"the trainer announces {announced} bytes for model {model!r}, more than "
                    f"a version of it can hold ({limit}: its tensors and their header)",
                    got=str(announced),
                    expected=f"at most {limit}",
                )
            send_frame(
                conn,
                lpb.LocalResponse(
                    publish_ready=lpb.PublishReady(max_bytes=limit)
                ).SerializeToString(),
            )
            try:
                second, fds = self._request(conn, deadline, 1)
            except FrameError as exc:
                if "file descriptors" in str(exc):
                    raise PublishRefused(
                        "the trainer sent more than one descriptor with its memfd request; "
                        "exactly one sealed memfd is expected (every one received was closed)"
                    ) from None
                raise
            if second.WhichOneof("request") != "publish_memfd" or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise PublishRefused(
                    f"expected a publish_memfd request with exactly one memfd, got "
                    f"{second.WhichOneof('request') or '(empty)'} with {len(fds)} descriptors"
                )
            conn.settimeout(None)

            def still_wanted() -> None:
                if peer_gone(conn):
                    raise PublishAborted(
                        "the trainer's connection closed before the version was committed: "
                        "nothing was published"
                    )

            published = self.publisher.publish_memory(model, fds[0], still_wanted)
            response = lpb.LocalResponse(published=_published_pb(published))
        except (OSError, FrameError):
            raise
        except Exception as exc:
            # the publish itself logs its own outcome; this says why a hand-over was refused
            log.warning("publish from memory on the admin side socket refused: %s", exc)
            response = lpb.LocalResponse(error=local_error(exc, "publish"))
        conn.settimeout(5.0)
        send_frame(conn, response.SerializeToString())

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns)
        shut_down(self._listener, self.path, conns)
        if self._thread is not None:
            self._thread.join(timeout=5)


def start_publish_socket(admin_socket_path: str, publisher: Publisher) -> PublishSocket:
    """The admin side socket beside ``admin_socket_path``, started: 0600, as the admin
    socket is even where the worker sockets are shared with a group."""
    server = PublishSocket(admin_socket_path + LOCAL_SOCKET_SUFFIX, publisher, socket_mode=0o600)
    server.start()
    return server
