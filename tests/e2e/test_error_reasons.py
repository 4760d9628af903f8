"""Errors keep their reason across the wire (issue #39, point 2).

Every daemon error class, generated from the hierarchy (not listed by hand), is sent
by the daemon's own edges from a server out of process and must reach a Python client
as its own type, through gRPC and through the side channel: a class of the daemon's
name or the situation class the client's table gives it, with the daemon's fields,
and still an instance of its status code's class. A peer without the detail (an old
daemon) still maps by code.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from tests.errors_server import error_classes, make_error
from weightd.client import WeightClient
from weightd.client.base import errors as ce
from weightd.client.transports.local import LocalConnection
from weightd.server.base.errors import LINEAGE_KEY, WeightdError
from weightd.server.rpc.status import grpc_code
from weightd.v1 import local_pb2 as lpb

pytestmark = pytest.mark.e2e

CLASSES = error_classes()
NAMES = sorted(CLASSES)


@pytest.fixture(scope="module")
def errors_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("errors")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.errors_server", str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        yield directory / "w.sock"
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(30)


def _expect(name: str, error: ce.WeightdError) -> None:
    cls = CLASSES[name]
    sent = make_error(cls)
    listed = ce.REASONS.get(name)
    if listed is not None:
        assert type(error) is listed, (name, type(error))
    else:
        assert type(error).__name__ == name, (name, type(error))
    assert error.reason == name
    assert error.code is grpc_code(cls.code)
    assert isinstance(error, ce.code_class(error.code)), type(error).__mro__
    assert error.detail == sent.message
    for key, value in sent.fields.items():
        assert error.metadata[key] == str(value), (name, key)
    assert LINEAGE_KEY in error.metadata or cls.__bases__ == (WeightdError,)


def test_the_hierarchy_is_found_whole() -> None:
    """The generator sees the classes added anywhere, not just in base/errors.py."""
    assert {"ModelNotFound", "HeaderSyntaxError", "TooManyStreams", "AdminOnly"} <= set(NAMES)
    assert len(NAMES) > 100


def test_every_daemon_class_arrives_as_its_own_type_over_grpc(errors_server: Path) -> None:
    seen: dict[type, str] = {}
    with WeightClient(str(errors_server), timeout=30) as client:
        for name in NAMES:
            with pytest.raises(ce.WeightdError) as info:
                client.describe(name)
            _expect(name, info.value)
            assert seen.setdefault(type(info.value), name) == name, "two reasons, one type"


def test_every_daemon_class_arrives_as_its_own_type_over_the_side_channel(
    errors_server: Path,
) -> None:
    from weightd.server.base.errors import TransportError

    for name in NAMES:
        conn = LocalConnection(f"{errors_server}.local", "shm", timeout=30)
        try:
            with pytest.raises(ce.WeightdError) as info:
                conn.exchange(lpb.LocalRequest(acquire=lpb.AcquirePack(model=name)))
        finally:
            conn.close()
        _expect(name, info.value)
        marked = issubclass(CLASSES[name], TransportError)
        assert (info.value.transport == "shm") is marked, name


@pytest.mark.parametrize("name", ["ModelNotFound", "HeaderSyntaxError", "OutsideRootError"])
def test_typed_errors_pickle_as_themselves(errors_server: Path, name: str) -> None:
    """vLLM hands a worker's exception to another process: the type survives pickling."""
    with (
        WeightClient(str(errors_server), timeout=30) as client,
        pytest.raises(ce.WeightdError) as info,
    ):
        client.describe(name)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value)
    assert (again.code, again.detail, again.reason, again.metadata) == (
        info.value.code,
        info.value.detail,
        info.value.reason,
        info.value.metadata,
    )


def test_situations_are_their_code_classes() -> None:
    """Every class of the table is still its status code's class (what callers caught)."""
    for reason, cls in ce.REASONS.items():
        assert issubclass(cls, ce.code_class(cls.code_name)), reason
        if reason in CLASSES:
            assert cls.code_name == grpc_code(CLASSES[reason].code).name, reason


def test_an_unknown_reason_finds_its_family_and_never_changes_code() -> None:
    newer = ce.error_for(
        9, "x", reason="HeaderFromTheFuture", metadata={LINEAGE_KEY: "HeaderError,CheckpointError"}
    )
    assert type(newer).__name__ == "HeaderFromTheFuture"
    assert isinstance(newer, ce.CheckpointInvalid)
    # A listed ancestor with another code is passed over: the code class still holds.
    odd = ce.error_for(7, "x", reason="Odd", metadata={LINEAGE_KEY: "CheckpointError"})
    assert isinstance(odd, ce.PermissionDeniedError)
    assert not isinstance(odd, ce.CheckpointInvalid)
    # A reason that is no class name is not made into one.
    junk = ce.error_for(5, "x", reason="not a name; \x00")
    assert type(junk) is ce.NotFoundError and junk.reason == "not a name; \x00"


# --- a peer without the detail: an old daemon, or not a daemon at all ---------------


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gRPC server that answers ``DescribeModel(model=CODE)`` with that code and no
    rich status, as a daemon from before reasons did (in this process: the client
    under test is what matters here, and it is as real as it gets)."""

    def describe(raw: bytes, context: grpc.ServicerContext) -> bytes:
        from weightd.v1 import weightd_pb2 as pb

        code = grpc.StatusCode[pb.DescribeModelRequest.FromString(raw).model]
        context.abort(code, f"plain {code.name}")
        raise AssertionError

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if details.method.endswith("/DescribeModel"):
                return grpc.unary_unary_rpc_method_handler(describe)
            return None

    path = tmp_path_factory.mktemp("plain") / "old.sock"
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([Handler()])
    server.add_insecure_port(f"unix://{path}")
    server.start()
    try:
        yield str(path)
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    "code", [c for c in grpc.StatusCode if c not in (grpc.StatusCode.OK,)], ids=lambda c: c.name
)
def test_an_old_daemon_maps_by_code(plain_server: str, code: grpc.StatusCode) -> None:
    with WeightClient(plain_server, timeout=30) as client, pytest.raises(ce.WeightdError) as info:
        client.describe(code.name)
    assert type(info.value) is ce.code_class(code)
    assert (info.value.code, info.value.detail, info.value.reason) == (
        code,
        f"plain {code.name}",
        "",
    )


def test_a_grpc_peer_without_the_method_is_said_plainly(plain_server: str) -> None:
    with (
        WeightClient(plain_server, timeout=30) as client,
        pytest.raises(ce.MethodNotServed) as info,
    ):
        client.list_models()
    assert "the admin socket of one, or not a weightd daemon" in str(info.value)
    assert isinstance(info.value, ce.UnimplementedError)


def test_a_peer_that_is_not_grpc_is_said_plainly(tmp_path: Path) -> None:
    import contextlib
    import socket
    import threading
    import time

    path = tmp_path / "http.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(4)

    def answer() -> None:
        while True:  # every connection gRPC makes (it reconnects) meets the same peer
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                # As an HTTP server does: read the request (gRPC's preface) first, then
                # answer; closing before reading made the client's write fail with EPIPE,
                # which says only that the peer went away, not what it speaks.
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
                    while conn.recv(65536):  # until the client hangs up
                        pass

    threading.Thread(target=answer, daemon=True).start()
    try:
        started = time.monotonic()
        with WeightClient(str(path), timeout=10) as client, pytest.raises(ce.NotWeightd) as info:
            client.list_models()
        # Said when the peer answers, not when the call's deadline ends: far below it
        # even on a loaded host (a fixed 2 s is a timing, and rule 6 keeps timings out).
        assert time.monotonic() - started < 8
        assert "not a weightd daemon" in str(info.value) and "\n" not in str(info.value)
    finally:
        listener.close()


def test_a_missing_socket_is_one_line_at_once(tmp_path: Path) -> None:
    import time

    path = tmp_path / "nobody.sock"
    started = time.monotonic()
    with WeightClient(str(path), timeout=30) as client, pytest.raises(ce.DaemonUnreachable) as info:
        client.list_models()
    assert time.monotonic() - started < 1
    text = str(info.value)
    assert f"no daemon at unix://{path}" in text and "--listen" in text and "\n" not in text
    assert "failed to connect" not in text
    assert os.path.exists(path) is False
