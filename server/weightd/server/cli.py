"""The ``weightd`` command line. Failures print one line, never a traceback."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

import grpc

from .cli_trust import add_parsers as add_trust_parsers
from .cli_trust import add_serve_options, run_manifest, run_verify, serve_verify_options
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
        help="allow TCP without TLS (logged loudly; off loopback, weights cross the network "
        "in clear)",
    )
    s.add_argument("--chunk-bytes", type=int, default=1 << 20, help="tensor bytes per message")
    s.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        dest="adapter_roots",
        metavar="DIR",
        help="a directory LoRA adapters may be loaded from (repeatable); none: no loads",
    )
    s.add_argument(
        "--adapter-budget-bytes",
        type=int,
        default=None,
        help="bytes of adapters held at once; unleased, unpinned ones are evicted LRU",
    )
    s.add_argument(
        "--watch-interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="check every served shard file this often: a changed one is reported, a "
        "chmod re-verified, a good file renamed into place restored (0: off)",
    )
    s.add_argument("--max-workers", type=int, default=16, help="RPC worker threads")
    s.add_argument(
        "--max-concurrent-rpcs", type=int, default=64, help="beyond this, RESOURCE_EXHAUSTED"
    )
    s.add_argument("--grace", type=float, default=30.0, help="seconds to drain after SIGTERM")
    s.add_argument("--cache-dir", default=None, help="where the demo checkpoint is created")
    s.add_argument(
        "--rules",
        action="append",
        default=[],
        metavar="FILE",
        help="sharding rules table (JSON) for an architecture (repeatable; before built-ins)",
    )
    s.add_argument("--log-level", default="INFO")
    _add_ops_args(s)
    add_serve_options(s)
    add_local_arguments(s)

    f = sub.add_parser("fetch", help="fetch one rank's slices into a safetensors file")
    f.add_argument("target", help="daemon address, e.g. unix:///run/weightd/weightd.sock")
    f.add_argument("--rank", type=int, required=True)
    f.add_argument("--world-size", type=int, required=True)
    f.add_argument("--model", default=None)
    f.add_argument("--name", action="append", dest="names", help="only this tensor (repeatable)")
    f.add_argument("--out", required=True, help="output .safetensors file")
    f.add_argument("--timeout", type=float, default=None)
    _add_client_tls_args(f)

    pl = sub.add_parser("plan", help="show each worker's share of a checkpoint under a layout")
    pl.add_argument("directory", help="checkpoint directory (only headers are read)")
    pl.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    pl.add_argument("--pp", type=int, default=1, help="pipeline stages")
    pl.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    pl.add_argument(
        "--pp-layers",
        type=_counts,
        default=(),
        metavar="N,N,...",
        help="decoder layers per stage (default: vLLM's even split)",
    )
    pl.add_argument("--rules", action="append", default=[], metavar="FILE")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--tensors", action="store_true", help="list every rank's tensors")

    ls = sub.add_parser("list", help="list the models a daemon serves")
    ls.add_argument("target")
    _add_client_tls_args(ls)

    d = sub.add_parser("describe", help="describe a served model's tensors")
    d.add_argument("target")
    d.add_argument("--model", default=None)
    d.add_argument("--json", action="store_true")
    _add_client_tls_args(d)

    h = sub.add_parser("health", help="exit 0 when the daemon reports SERVING (gRPC health)")
    h.add_argument("target")
    h.add_argument("--service", default="", help="'' overall, or weightd.v1.Weights/MODEL")
    h.add_argument("--wait", type=float, default=0.0, help="keep polling up to this many seconds")
    _add_client_tls_args(h)

    r = sub.add_parser("reload", help="re-verify a model from disk (admin listener only)")
    r.add_argument("target", help="the admin address, e.g. unix:///run/weightd/admin.sock")
    r.add_argument("--model", default=None)
    r.add_argument("--timeout", type=float, default=None)
    _add_client_tls_args(r)

    demo = sub.add_parser(
        "demo-checkpoint", help="create (if needed) and print the demo checkpoint"
    )
    demo.add_argument("--cache-dir", default=None)
    add_trust_parsers(sub)
    return p


def _add_ops_args(s: argparse.ArgumentParser) -> None:
    """``serve`` flags for operations: TLS, admin, metrics, health, reflection, logs, bounds."""
    s.add_argument("--tls-cert", default=None, help="PEM certificate chain for TCP listeners")
    s.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    s.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle: require client certificates signed by it (mutual TLS)",
    )
    s.add_argument(
        "--admin-listen",
        default=None,
        help="admin RPC address: unix:///PATH.sock, HOST:PORT (mutual TLS + --admin-allow), "
        "or 'none' (default: admin.sock next to the worker socket)",
    )
    s.add_argument(
        "--admin-allow",
        action="append",
        default=[],
        metavar="IDENTITY",
        help="client certificate CN/SAN allowed to call admin RPCs over TCP (repeatable)",
    )
    s.add_argument(
        "--metrics-listen",
        default=None,
        metavar="HOST:PORT",
        help="serve Prometheus metrics over HTTP here (host defaults to 127.0.0.1; port 0 "
        "picks one, logged)",
    )
    s.add_argument(
        "--health-listen",
        default=None,
        metavar="HOST:PORT",
        help="plaintext gRPC listener with only grpc.health.v1 (Kubernetes gRPC probes)",
    )
    s.add_argument("--reflection", action="store_true", help="serve gRPC server reflection")
    s.add_argument("--log-json", action="store_true", help="log JSON lines")
    s.add_argument(
        "--max-stream-seconds",
        type=float,
        default=3600.0,
        help="cancel a Fetch stream running longer than this, whatever the client's deadline "
        "(0: no cap)",
    )


def _add_client_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=None, help="connect with TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert", default=None, help="client certificate for mutual TLS (PEM)")
    p.add_argument("--tls-key", default=None, help="client key for --tls-cert (PEM)")


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if args.tls_ca is None and args.tls_cert is None:
        return None
    from weightd.client import tls_credentials

    try:
        return tls_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        raise WeightdError(str(exc)) from None


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _plan(args: argparse.Namespace) -> int:
    from .planreport import run_plan

    print(
        run_plan(
            args.directory,
            args.tp,
            args.pp,
            args.ep,
            args.pp_layers,
            args.rules,
            json_out=args.json,
            tensors=args.tensors,
        )
    )
    return 0


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
    names = [name or os.path.basename(os.path.realpath(d)) for name, d in models]
    verify = serve_verify_options(args, names, _cache_dir(args.cache_dir))
    config = ServeConfig(
        models=models,
        listen=args.listen or f"unix://{default_socket_path()}",
        insecure=args.insecure,
        max_workers=args.max_workers,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        chunk_bytes=args.chunk_bytes,
        grace_seconds=args.grace,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        admin_listen=args.admin_listen,
        admin_allow=args.admin_allow,
        metrics_listen=args.metrics_listen,
        health_listen=args.health_listen,
        reflection=args.reflection,
        max_stream_seconds=args.max_stream_seconds,
        rules_files=args.rules,
        verify=verify,
        local=from_arguments(args),
        adapter_roots=args.adapter_roots,
        watch_seconds=args.watch_interval,
        adapter_budget_bytes=args.adapter_budget_bytes,
    )
    return serve(config)


def _fetch(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from weightd.client import WeightClient

    from .atomicio import atomic_output

    creds = _credentials(args)
    with WeightClient(args.target, timeout=args.timeout, credentials=creds) as client:
        state = client.fetch(args.rank, args.world_size, model=args.model, names=args.names)
    # Written aside and renamed: a full disk leaves the previous file, no partial one.
    with atomic_output(args.out) as tmp:
        save_file(
            state,
            tmp,
            metadata={"weightd_rank": str(args.rank), "weightd_world_size": str(args.world_size)},
        )
    total = sum(t.numel() * t.element_size() for t in state.values())
    where = f"rank {args.rank}/{args.world_size}"
    print(f"wrote {len(state)} tensors, {total} bytes, {where} -> {args.out}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    with WeightClient(args.target, credentials=_credentials(args)) as client:
        for m in client.list_models():
            state = "ready" if m.ready else "not ready"
            if m.state and m.state not in ("ready", "loading"):
                state = f"{m.state}: {m.reason}"
            size = f"{m.num_tensors} tensors\t{m.total_bytes} bytes"
            print(f"{m.name}\t{m.architecture}\t{size}\t{state}")
    return 0


def _describe(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    with WeightClient(args.target, credentials=_credentials(args)) as client:
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

    from grpc_health.v1 import health_pb2

    deadline = time.monotonic() + args.wait
    status = "UNREACHABLE"
    creds = _credentials(args)
    channel = (
        grpc.insecure_channel(args.target)
        if creds is None
        else grpc.secure_channel(args.target, creds)
    )
    with channel:
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


def _reload(args: argparse.Namespace) -> int:
    from weightd.client import AdminClient

    creds = _credentials(args)
    with AdminClient(args.target, timeout=args.timeout, credentials=creds) as admin:
        r = admin.reload(args.model)
    print(
        f"reloaded {r.model}: {r.num_tensors} tensors, {r.total_bytes} bytes verified in "
        f"{r.verify_seconds:.2f}s"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .logs import setup_logging

    setup_logging(getattr(args, "log_level", "INFO"), json_lines=getattr(args, "log_json", False))
    # Only the client commands import the client (and so torch): verify, manifest and
    # serve start seconds faster without it.
    explained: tuple[type[Exception], ...] = (WeightdError,)
    if args.command in ("fetch", "list", "describe", "reload"):
        from weightd.client.errors import WeightdError as ClientError

        explained = (WeightdError, ClientError)

    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "fetch":
            return _fetch(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "list":
            return _list(args)
        if args.command == "describe":
            return _describe(args)
        if args.command == "health":
            return _health(args)
        if args.command == "reload":
            return _reload(args)
        if args.command == "verify":
            return run_verify(args)
        if args.command == "manifest":
            return run_manifest(args)
        print(_demo_path(args))
        return 0
    except explained as exc:
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
