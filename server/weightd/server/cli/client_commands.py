"""The client commands of the CLI: ``weightd fetch``, ``list``, ``describe``, ``health``
and ``reload``, and the TLS flags they share. Kept apart from ``cli.py``, which
registers, dispatches and runs the local commands (``serve``, ``plan``,
``demo-checkpoint``; ``trust_commands`` has the trust ones): these are clients of a
running daemon over gRPC, most of them through ``weightd.client`` (and so torch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import grpc

from ..base.errors import WeightdError
from .targets import daemon_target, missing_socket, not_connected, unreachable


def add_fetch_parser(sub: Any) -> None:
    """``weightd fetch``; registered apart from the others to keep the help's order."""
    f = sub.add_parser("fetch", help="fetch one rank's slices into a safetensors file")
    f.add_argument("target", help="daemon address, e.g. unix:///run/weightd/weightd.sock")
    f.add_argument("--rank", type=int, required=True)
    f.add_argument("--world-size", type=int, required=True)
    f.add_argument(
        "--vocab-pad",
        type=int,
        default=0,
        metavar="N",
        help="vocabulary-parallel tensors as vLLM cuts them, padded to a multiple of N "
        "(vLLM: 64); default 0: equal blocks",
    )
    f.add_argument("--model", default=None)
    f.add_argument("--name", action="append", dest="names", help="only this tensor (repeatable)")
    f.add_argument("--out", required=True, help="output .safetensors file")
    f.add_argument("--timeout", type=float, default=None)
    _add_client_tls_args(f)


def add_parsers(sub: Any) -> None:
    """``weightd list``, ``describe``, ``health``, ``reload`` and ``publish``."""
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

    p = sub.add_parser(
        "publish",
        help="serve a new checkpoint (a directory or s3:// prefix) as a model's next version "
        "(admin listener only)",
    )
    p.add_argument("source", help="an absolute checkpoint directory or an s3:// prefix")
    p.add_argument("--model", default=None, help="the served model (default: the only one)")
    p.add_argument(
        "--admin",
        default=None,
        help="the admin address (default: admin.sock beside the default worker socket)",
    )
    p.add_argument("--manifest", default=None, help="the checkpoint's manifest (file or s3://)")
    p.add_argument("--timeout", type=float, default=None)
    _add_client_tls_args(p)


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


@contextlib.contextmanager
def _daemon_at(text: str) -> Iterator[str]:
    """The gRPC target for ``text``; "no daemon there" said plainly, before and during calls.

    Only a failure to connect becomes :class:`DaemonUnreachable`; an UNAVAILABLE the
    daemon answered itself (a model still verifying) keeps its own words.
    """
    from weightd.client.errors import UnavailableError

    target = daemon_target(text)
    missing = missing_socket(target)
    if missing is not None:
        raise missing
    try:
        yield target
    except UnavailableError as exc:
        if not_connected(exc.detail):
            raise unreachable(target, exc.detail) from None
        raise


def run_fetch(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from weightd.client import Layout, WeightClient

    from ..base.atomicio import atomic_output

    creds = _credentials(args)
    with (
        _daemon_at(args.target) as target,
        WeightClient(target, timeout=args.timeout, credentials=creds) as client,
    ):
        layout = Layout(tp_size=args.world_size, tp_rank=args.rank, vocab_pad=args.vocab_pad)
        state = client.fetch_layout(layout, model=args.model, names=args.names)
    metadata = {"weightd_rank": str(args.rank), "weightd_world_size": str(args.world_size)}
    if args.vocab_pad:
        metadata["weightd_vocab_pad"] = str(args.vocab_pad)
    # Written aside and renamed: a full disk leaves the previous file, no partial one.
    with atomic_output(args.out) as tmp:
        save_file(state, tmp, metadata=metadata)
    total = sum(t.numel() * t.element_size() for t in state.values())
    where = f"rank {args.rank}/{args.world_size}"
    print(f"wrote {len(state)} tensors, {total} bytes, {where} -> {args.out}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    with (
        _daemon_at(args.target) as target,
        WeightClient(target, credentials=_credentials(args)) as client,
    ):
        for m in client.list_models():
            state = "ready" if m.ready else "not ready"
            if m.state and m.state not in ("ready", "loading"):
                state = f"{m.state}: {m.reason}"
            size = f"{m.num_tensors} tensors\t{m.total_bytes} bytes"
            version = f"\tversion {m.version}" if m.version else ""
            print(f"{m.name}\t{m.architecture}\t{size}\t{state}{version}")
    return 0


def run_describe(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    with (
        _daemon_at(args.target) as target,
        WeightClient(target, credentials=_credentials(args)) as client,
    ):
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


def run_health(args: argparse.Namespace) -> int:
    import time

    from grpc_health.v1 import health_pb2

    deadline = time.monotonic() + args.wait
    target = daemon_target(args.target)
    creds = _credentials(args)
    channel = grpc.insecure_channel(target) if creds is None else grpc.secure_channel(target, creds)
    with channel:
        # Called by method path: the typeshed stub of HealthStub lacks its methods.
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        while True:
            missing = missing_socket(target)
            if missing is not None:
                status = f"UNREACHABLE ({missing})"
            else:
                try:
                    reply = check(health_pb2.HealthCheckRequest(service=args.service), timeout=2)
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.RpcError as exc:
                    status = health_failure(target, args.service, exc.code(), exc.details() or "")
            if status == "SERVING" or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    print(f"{target} {args.service or '(overall)'}: {status}")
    return 0 if status == "SERVING" else 1


def health_failure(target: str, service: str, code: grpc.StatusCode, detail: str) -> str:
    """What a failed health ``Check`` means: only a call that reached no daemon is
    UNREACHABLE; any other code is the daemon's own answer, and is said to be."""
    if code == grpc.StatusCode.NOT_FOUND:
        return f"NOT_FOUND (the daemon answered: it has no health status for {service!r})"
    silent = code == grpc.StatusCode.DEADLINE_EXCEEDED
    if silent or (code == grpc.StatusCode.UNAVAILABLE and not_connected(detail)):
        return f"UNREACHABLE ({unreachable(target, f'{code.name}: {detail}')})"
    return f"{code.name} (the daemon answered: {detail})"


def run_publish(args: argparse.Namespace) -> int:
    import os

    from weightd.client import AdminClient
    from weightd.common.sockets import default_socket_path

    creds = _credentials(args)
    source = args.source
    if "://" not in source:
        source = os.path.abspath(source)  # the daemon refuses relative paths
    admin = (
        args.admin or f"unix://{os.path.join(os.path.dirname(default_socket_path()), 'admin.sock')}"
    )
    with (
        _daemon_at(admin) as target,
        AdminClient(target, timeout=args.timeout, credentials=creds) as client,
    ):
        r = client.publish(source, model=args.model, manifest=args.manifest)
    print(
        f"published {r.model} version {r.version} from {r.source}: {r.num_tensors} tensors, "
        f"{r.total_bytes} bytes verified in {r.verify_seconds:.2f}s, {r.packs_built} packs "
        f"prepared in {r.prepare_seconds:.2f}s"
    )
    return 0


def run_reload(args: argparse.Namespace) -> int:
    from weightd.client import AdminClient

    creds = _credentials(args)
    with (
        _daemon_at(args.target) as target,
        AdminClient(target, timeout=args.timeout, credentials=creds) as admin,
    ):
        r = admin.reload(args.model)
    print(
        f"reloaded {r.model}: {r.num_tensors} tensors, {r.total_bytes} bytes verified in "
        f"{r.verify_seconds:.2f}s"
    )
    return 0
