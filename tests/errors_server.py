"""A server that answers with any daemon error class, through the daemon's own edges.

``python -m tests.errors_server DIR`` binds ``DIR/w.sock`` (gRPC) and ``DIR/w.sock.local``
(the side channel) and prints ``ready``. ``DescribeModel`` for model ``NAME`` raises an
instance of the daemon's error class ``NAME`` and ends the call with the daemon's
:func:`weightd.server.rpc.status.abort`; a side-channel ``AcquirePack`` for model
``NAME`` answers the daemon's :func:`~weightd.server.transports.local_service.local_error`
over real frames. Nothing is stubbed on the client side: the test's ``WeightClient``
and ``LocalConnection`` read what the daemon would send.

Also importable: :func:`error_classes` (every ``WeightdError`` subclass in the daemon's
packages) and :func:`make_error` (an instance with every field filled).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import socket
import sys
import threading
from concurrent import futures
from typing import Any

import grpc

import weightd.server
from weightd.common.frames import recv_frame, send_frame
from weightd.server.base.errors import WeightdError
from weightd.server.rpc.status import abort
from weightd.server.transports.local_service import local_error
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb


def error_classes() -> dict[str, type[WeightdError]]:
    """Every daemon error class by name, from every module of the daemon's packages."""
    for info in pkgutil.walk_packages(weightd.server.__path__, "weightd.server."):
        if not info.name.endswith("__main__"):  # runs the CLI when imported
            importlib.import_module(info.name)
    found: dict[str, type[WeightdError]] = {}
    todo: list[type[WeightdError]] = [WeightdError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            assert found.get(sub.__name__, sub) is sub, f"two classes named {sub.__name__}"
            found[sub.__name__] = sub
            todo.append(sub)
    return found


def make_error(cls: type[WeightdError]) -> WeightdError:
    """An instance of ``cls``: each argument its constructor needs named after itself,
    and ``model``/``tensor`` fields where it takes keyword fields."""
    args: dict[str, Any] = {}
    takes_fields = False
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "self":
            continue
        if param.kind is param.VAR_KEYWORD:
            takes_fields = True
        elif param.kind is not param.VAR_POSITIONAL and param.default is param.empty:
            args[name] = f"{name} of {cls.__name__}"
    if takes_fields:
        args.update(model="m1", tensor="t.weight")
    return cls(**args)


def _raise(name: str, classes: dict[str, type[WeightdError]]) -> WeightdError:
    cls = classes.get(name)
    if cls is None:
        return WeightdError(f"no daemon error class {name!r}")  # the test asked for a typo
    return make_error(cls)


def main() -> None:
    directory = sys.argv[1]
    classes = error_classes()
    path = os.path.join(directory, "w.sock")

    def describe(raw: bytes, context: grpc.ServicerContext) -> bytes:
        name = pb.DescribeModelRequest.FromString(raw).model
        abort(context, _raise(name, classes), "DescribeModel")

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> Any:
            if details.method == "/weightd.v1.Weights/DescribeModel":
                return grpc.unary_unary_rpc_method_handler(describe)
            return None

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([Handler()])
    server.add_insecure_port(f"unix://{path}")
    server.start()

    side = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    side.bind(path + ".local")
    side.listen(16)

    def answer(conn: socket.socket) -> None:
        with conn:
            send_frame(conn, lpb.LocalHello(protocol_version=1, boot_id="b").SerializeToString())
            got = recv_frame(conn, max_bytes=1 << 20)
            if got is None:
                return
            name = lpb.LocalRequest.FromString(got[0]).acquire.model
            error = local_error(_raise(name, classes), "acquire")
            send_frame(conn, lpb.LocalResponse(error=error).SerializeToString())

    def accept() -> None:
        while True:
            conn, _ = side.accept()
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    server.stop(0)


if __name__ == "__main__":
    main()
