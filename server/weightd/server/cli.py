"""The ``weightd`` command line. Failures print one line, never a traceback."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from .errors import WeightdError
from .listen import default_socket_path
from .transports.options import add_arguments as add_local_arguments

log = logging.getLogger("weightd")


def _model_arg(text: str) -> tuple[str | None, str]:
    name, sep, directory = text.partition("=")
    if sep and name and "/" not in name:
        return name, directory
    return None, text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightd", description="Serve verified per-rank slices of model checkpoints."
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the daemon")
    s.add_argument(
        "--model",
        action="append",
        type=_model_arg,
        metavar="[NAME=]DIR",
        help="checkpoint directory to serve (repeatable); default: the built-in demo checkpoint",
    )
    s.add_argument(
        "--listen",
        default=None,
        help="gRPC address: unix:///PATH.sock or HOST:PORT "
        f"(default: unix://{default_socket_path()})",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback TCP address without TLS (weights cross the network in clear)",
    )
    s.add_argument("--chunk-bytes", type=int, default=1 << 20, help="tensor bytes per message")
    s.add_argument("--max-workers", type=int, default=16, help="RPC worker threads")
    s.add_argument(
        "--max-concurrent-rpcs", type=int, default=64, help="beyond this, RESOURCE_EXHAUSTED"
    )
    s.add_argument("--grace", type=float, default=30.0, help="seconds to drain after SIGTERM")
    s.add_argument("--cache-dir", default=None, help="where the demo checkpoint is created")
    s.add_argument("--log-level", default="INFO")
    add_local_arguments(s)

    f = sub.add_parser("fetch", help="fetch one rank's slices into a safetensors file")
    f.add_argument("target", help="daemon address, e.g. unix:///run/weightd/weightd.sock")
    f.add_argument("--rank", type=int, required=True)
    f.add_argument("--world-size", type=int, required=True)
    f.add_argument("--model", default=None)
    f.add_argument("--name", action="append", dest="names", help="only this tensor (repeatable)")
    f.add_argument("--out", required=True, help="output .safetensors file")
    f.add_argument("--timeout", type=float, default=None)

    ls = sub.add_parser("list", help="list the models a daemon serves")
    ls.add_argument("target")

    d = sub.add_parser("describe", help="describe a served model's tensors")
    d.add_argument("target")
    d.add_argument("--model", default=None)
    d.add_argument("--json", action="store_true")

    h = sub.add_parser("health", help="exit 0 when the daemon reports SERVING (gRPC health)")
    h.add_argument("target")
    h.add_argument("--service", default="", help="'' overall, or weightd.v1.Weights/MODEL")
    h.add_argument("--wait", type=float, default=0.0, help="keep polling up to this many seconds")

    demo = sub.add_parser(
        "demo-checkpoint", help="create (if needed) and print the demo checkpoint"
    )
    demo.add_argument("--cache-dir", default=None)
    return p


def _cache_dir(arg: str | None) -> str:
    from .demo import default_cache_dir

    return arg or default_cache_dir(dict(os.environ))


def _serve(args: argparse.Namespace) -> int:
    from .daemon import ServeConfig, serve
    from .demo import DEMO_NAME, ensure_demo_checkpoint
    from .transports.options import from_arguments

    models: list[tuple[str | None, str]] = args.model or []
    if not models:
        path = ensure_demo_checkpoint(_cache_dir(args.cache_dir))
        log.info("no --model given: serving the built-in demo checkpoint at %s", path)
        models = [(DEMO_NAME, path)]
    config = ServeConfig(
        models=models,
        listen=args.listen or f"unix://{default_socket_path()}",
        insecure=args.insecure,
        max_workers=args.max_workers,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        chunk_bytes=args.chunk_bytes,
        grace_seconds=args.grace,
        local=from_arguments(args),
    )
    return serve(config)


def _fetch(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from weightd.client import WeightClient

    with WeightClient(args.target, timeout=args.timeout) as client:
        state = client.fetch(args.rank, args.world_size, model=args.model, names=args.names)
    tmp = args.out + ".tmp"
    save_file(
        state,
        tmp,
        metadata={"weightd_rank": str(args.rank), "weightd_world_size": str(args.world_size)},
    )
    os.replace(tmp, args.out)
    total = sum(t.numel() * t.element_size() for t in state.values())
    where = f"rank {args.rank}/{args.world_size}"
    print(f"wrote {len(state)} tensors, {total} bytes, {where} -> {args.out}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    with WeightClient(args.target) as client:
        for m in client.list_models():
            state = "ready" if m.ready else "not ready"
            size = f"{m.num_tensors} tensors\t{m.total_bytes} bytes"
            print(f"{m.name}\t{m.architecture}\t{size}\t{state}")
    return 0


def _describe(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    with WeightClient(args.target) as client:
        d = client.describe(args.model)
    if args.json:
        print(
            json.dumps(
                {
                    "name": d.name,
                    "architecture": d.architecture,
                    "total_bytes": d.total_bytes,
                    "tensors": [t.__dict__ | {"shape": list(t.shape)} for t in d.tensors],
                },
                indent=2,
            )
        )
        return 0
    print(f"{d.name} ({d.architecture}): {len(d.tensors)} tensors, {d.total_bytes} bytes")
    for t in d.tensors:
        print(f"  {t.name}\t{t.dtype}\t{list(t.shape)}\t{t.shard}\t{t.digest[:23]}...")
    return 0


def _health(args: argparse.Namespace) -> int:
    import time

    import grpc
    from grpc_health.v1 import health_pb2

    deadline = time.monotonic() + args.wait
    status = "UNREACHABLE"
    with grpc.insecure_channel(args.target) as channel:
        # Called by method path: the typeshed stub of HealthStub lacks its methods.
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        while True:
            try:
                reply = check(health_pb2.HealthCheckRequest(service=args.service), timeout=2)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                status = f"UNREACHABLE ({exc.code().name})"
            if status == "SERVING" or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    print(f"{args.target} {args.service or '(overall)'}: {status}")
    return 0 if status == "SERVING" else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from weightd.client.errors import WeightdError as ClientError

    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "fetch":
            return _fetch(args)
        if args.command == "list":
            return _list(args)
        if args.command == "describe":
            return _describe(args)
        if args.command == "health":
            return _health(args)
        print(_demo_path(args))
        return 0
    except (WeightdError, ClientError) as exc:
        print(f"weightd {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"weightd {args.command}: error: {exc}", file=sys.stderr)
        return 1


def _demo_path(args: argparse.Namespace) -> str:
    from .demo import ensure_demo_checkpoint

    return ensure_demo_checkpoint(_cache_dir(args.cache_dir))


if __name__ == "__main__":
    sys.exit(main())
