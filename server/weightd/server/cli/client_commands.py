"""The client commands of the CLI: ``weightd fetch``, ``list``, ``describe``, ``health``
and ``reload``, and the address and TLS flags they share. Kept apart from ``main.py``,
which registers, dispatches and runs the local commands (``serve``, ``plan``,
``demo-checkpoint``; ``trust_commands`` has the trust ones): these are clients of a
running daemon over gRPC, through ``weightd.client``.

Every command takes the daemon's address by the one rule (``weightd.common.addresses``:
a socket path, ``unix://``, ``unix:///``, ``HOST:PORT``), positional as before or as
``--target``, and defaults to the daemon's default socket (``reload``: the admin socket
beside it). What goes wrong reaching the daemon is the client's typed error, one line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import grpc

from weightd.common.sockets import default_admin_path, default_socket_path

from ..base.errors import UsageError, WeightdError
from ..base.words import count

ADDRESS_FORMS = "a socket path (./w.sock, /run/x.sock), unix:///PATH or HOST:PORT"


def _add_target(p: argparse.ArgumentParser, default: str, *, admin: bool = False) -> None:
    """The daemon's address: positional (as before) or ``--target``; both optional."""
    what = "the daemon's admin address" if admin else "the daemon's address"
    p.add_argument(
        "target",
        nargs="?",
        default=None,
        help=f"{what}: {ADDRESS_FORMS} (default: {default})",
    )
    p.add_argument("--target", dest="target_flag", metavar="ADDRESS", help="the same, as a flag")


def target_of(args: argparse.Namespace) -> str | None:
    """The address given (positional or ``--target``), or None for the default."""
    flag: str | None = getattr(args, "target_flag", None)
    if flag is not None and args.target is not None and flag != args.target:
        raise UsageError(f"two addresses given: {args.target!r} and --target {flag!r}")
    return flag if flag is not None else args.target


def add_fetch_parser(sub: Any) -> None:
    """``weightd fetch``; registered apart from the others to keep the help's order."""
    f = sub.add_parser(
        "fetch",
        help="fetch one rank's slices into a safetensors file",
        description="Fetch one worker's slices of a served model into a .safetensors file "
        "(shared memory on the daemon's host, gRPC otherwise; every slice digest-checked).",
    )
    _add_target(f, f"unix://{default_socket_path()}")
    f.add_argument(
        "--rank",
        type=int,
        required=True,
        help="this worker's tensor-parallel rank, 0 .. world size - 1",
    )
    f.add_argument(
        "--world-size",
        type=int,
        required=True,
        help="tensor-parallel size: the number of ranks each tensor is split across",
    )
    f.add_argument(
        "--pp", type=int, default=1, metavar="N", help="pipeline stages (as in plan); default 1"
    )
    f.add_argument("--pp-rank", type=int, default=0, metavar="I", help="this worker's stage")
    f.add_argument("--ep", type=int, default=1, metavar="N", help="expert-parallel size")
    f.add_argument("--ep-rank", type=int, default=0, metavar="I", help="this worker's expert rank")
    f.add_argument(
        "--vocab-pad",
        type=int,
        default=0,
        metavar="N",
        help="vocabulary-parallel tensors as vLLM cuts them, padded to a multiple of N "
        "(vLLM: 64); default 0: equal blocks",
    )
    f.add_argument(
        "--model",
        default=None,
        help="the served model's name (see `weightd list`); default: the daemon's only model",
    )
    f.add_argument("--name", action="append", dest="names", help="only this tensor (repeatable)")
    f.add_argument("--out", required=True, help="output .safetensors file")
    f.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="bound on each call to the daemon; default: none",
    )
    f.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress on stderr: auto (when stderr is a terminal), always, never",
    )
    _add_client_tls_args(f)


def add_parsers(sub: Any) -> None:
    """``weightd list``, ``describe``, ``health``, ``reload`` and ``publish``."""
    worker = f"unix://{default_socket_path()}"
    ls = sub.add_parser("list", help="list the models a daemon serves")
    _add_target(ls, worker)
    _add_client_tls_args(ls)

    d = sub.add_parser("describe", help="describe a served model's tensors")
    _add_target(d, worker)
    d.add_argument("--model", default=None)
    d.add_argument("--json", action="store_true")
    _add_client_tls_args(d)

    h = sub.add_parser("health", help="exit 0 when the daemon reports SERVING (gRPC health)")
    _add_target(h, worker)
    h.add_argument("--service", default="", help="'' overall, or weightd.v1.Weights/MODEL")
    h.add_argument("--wait", type=float, default=0.0, help="keep polling up to this many seconds")
    _add_client_tls_args(h)

    r = sub.add_parser("reload", help="re-verify a model from disk (admin listener only)")
    _add_target(r, f"unix://{default_admin_path()}", admin=True)
    r.add_argument("--model", default=None)
    r.add_argument("--timeout", type=float, default=None)
    _add_client_tls_args(r)

    p = sub.add_parser(
        "publish",
        help="serve a new checkpoint (a directory or s3:// prefix) as a model's next version "
        "(admin listener only)",
    )
    p.add_argument(
        "source",
        nargs="?",
        default=None,
        help="an absolute checkpoint directory or an s3:// prefix",
    )
    p.add_argument(
        "--tensors",
        nargs="+",
        metavar="FILE",
        default=None,
        help="instead of a source: read these safetensors files into memory and publish "
        "their tensors from memory (the daemon's host: a sealed memfd; else gRPC), as a "
        "trainer's publish_tensors does; nothing is written to disk",
    )
    p.add_argument(
        "--transport",
        choices=("auto", "shm", "grpc"),
        default="auto",
        help="with --tensors: how the bytes reach the daemon (default: shm where the "
        "admin side socket exists)",
    )
    p.add_argument("--model", default=None, help="the served model (default: the only one)")
    p.add_argument(
        "--target",
        "--admin",
        dest="target_flag",
        metavar="ADDRESS",
        help=f"the daemon's admin address: {ADDRESS_FORMS} "
        f"(default: unix://{default_admin_path()})",
    )
    p.set_defaults(target=None)
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


def _target(args: argparse.Namespace, *, admin: bool = False) -> str:
    """The gRPC target of the address given (the default socket when none was)."""
    from weightd.client.api.addresses import connect_target

    given = target_of(args)
    if given is None and admin:
        given = default_admin_path()
    return connect_target(given)


def run_fetch(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from weightd.client import Layout, WeightClient

    from ..base.atomicio import atomic_output
    from .progress import FetchProgress

    layout = Layout(
        tp_size=args.world_size,
        tp_rank=args.rank,
        pp_size=args.pp,
        pp_rank=args.pp_rank,
        ep_size=args.ep,
        ep_rank=args.ep_rank,
        vocab_pad=args.vocab_pad,
    )
    target = _target(args)
    creds = _credentials(args)
    with FetchProgress.for_mode(args.progress, f"{layout.describe()} from {target}") as progress:
        with WeightClient(
            target, timeout=args.timeout, credentials=creds, on_tensor=progress.tensor
        ) as client:
            state = client.fetch_layout(layout, model=args.model, names=args.names)
            how = client.last_fetch.transport if client.last_fetch is not None else "?"
        progress.step(f"writing {args.out}")
        metadata = {"weightd_rank": str(args.rank), "weightd_world_size": str(args.world_size)}
        if args.vocab_pad:
            metadata["weightd_vocab_pad"] = str(args.vocab_pad)
        if args.pp > 1 or args.ep > 1:
            metadata["weightd_layout"] = layout.describe()
        # Written aside and renamed: a full disk leaves the previous file, no partial one.
        with atomic_output(args.out) as tmp:
            save_file(state, tmp, metadata=metadata)
    total = sum(t.numel() * t.element_size() for t in state.values())
    where = f"rank {args.rank}/{args.world_size}"
    if args.pp > 1 or args.ep > 1:
        where = layout.describe()
    print(f"wrote {count(len(state), 'tensor')}, {total} bytes, {where} (over {how}) -> {args.out}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    with WeightClient(_target(args), credentials=_credentials(args)) as client:
        for m in client.list_models():
            state = "ready" if m.ready else "not ready"
            if m.state and m.state not in ("ready", "loading"):
                state = f"{m.state}: {m.reason}"
            size = f"{m.num_tensors} tensors\t{m.total_bytes} bytes"
            version = f"\tversion {m.version}" if m.version else ""
            trust = f"\ttrust {m.trust_root or 'digests at load only'}" if m.ready else ""
            print(f"{m.name}\t{m.architecture}\t{size}\t{state}{version}{trust}")
    return 0


def run_describe(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    with WeightClient(_target(args), credentials=_credentials(args)) as client:
        d = client.describe(args.model)
    if args.json:
        print(
            json.dumps(
                {
                    "name": d.name,
                    "architecture": d.architecture,
                    "total_bytes": d.total_bytes,
                    "trust_root": d.trust_root,
                    "tensors": [t.__dict__ | {"shape": list(t.shape)} for t in d.tensors],
                },
                indent=2,
            )
        )
        return 0
    print(f"{d.name} ({d.architecture}): {count(len(d.tensors), 'tensor')}, {d.total_bytes} bytes")
    print(f"  trust: {d.trust_root or 'the digests computed at load only'}")
    for t in d.tensors:
        print(f"  {t.name}\t{t.dtype}\t{list(t.shape)}\t{t.shard}\t{t.digest[:23]}...")
    return 0


def run_health(args: argparse.Namespace) -> int:
    import time

    from grpc_health.v1 import health_pb2

    from weightd.client.api.addresses import missing_socket

    deadline = time.monotonic() + args.wait
    target = _target(args)
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
                status = f"UNREACHABLE ({missing.detail})"
            else:
                try:
                    reply = check(health_pb2.HealthCheckRequest(service=args.service), timeout=2)
                    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.RpcError as exc:
                    status = health_failure(target, args.service, exc)
            if status == "SERVING" or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
    print(f"{target} {args.service or '(overall)'}: {status}")
    return 0 if status == "SERVING" else 1


def health_failure(target: str, service: str, exc: grpc.RpcError) -> str:
    """What a failed health ``Check`` means: only a call that reached no daemon is
    UNREACHABLE; any other code is the daemon's own answer, and is said to be."""
    from weightd.client.api.addresses import from_call

    error = from_call(exc, target)
    code = error.code
    if code == grpc.StatusCode.NOT_FOUND:
        return f"NOT_FOUND (the daemon answered: it has no health status for {service!r})"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"UNREACHABLE (no daemon answered at {target} in time)"
    if error.reason in ("DaemonUnreachable", "NotWeightd"):
        return f"UNREACHABLE ({error.detail})"
    return f"{code.name} (the daemon answered: {error.detail})"


def run_publish(args: argparse.Namespace) -> int:
    import os

    from weightd.client import AdminClient

    creds = _credentials(args)
    if (args.source is None) == (args.tensors is None):
        raise UsageError("weightd publish takes a source or --tensors FILE..., not both")
    target = _target(args, admin=True)
    if args.tensors is not None:
        if args.manifest is not None:
            raise UsageError("--manifest names a checkpoint's files; --tensors has none")
        tensors = read_tensor_files(args.tensors)
        with AdminClient(target, timeout=args.timeout, credentials=creds) as client:
            r = client.publish_tensors(tensors, model=args.model, transport=args.transport)
    else:
        source = args.source
        if "://" not in source:
            source = os.path.abspath(source)  # the daemon refuses relative paths
        with AdminClient(target, timeout=args.timeout, credentials=creds) as client:
            r = client.publish(source, model=args.model, manifest=args.manifest)
    print(
        f"published {r.model} version {r.version} from {r.source}: {r.num_tensors} tensors, "
        f"{r.total_bytes} bytes verified in {r.verify_seconds:.2f}s, {r.packs_built} packs "
        f"prepared in {r.prepare_seconds:.2f}s"
    )
    return 0


def read_tensor_files(paths: list[str]) -> list[tuple[str, Any]]:
    """Every tensor of the safetensors ``paths`` as ``(name, RawTensor)``, read into
    memory (each file's data once) and parsed with the daemon's strict header parser."""
    import os

    from weightd.client.api.publishing import RawTensor

    from ..base.errors import CheckpointError
    from ..checkpoint.header import header_length, parse_header

    out: list[tuple[str, Any]] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                length = header_length(path, f.read(8), size)
                header = parse_header(path, f.read(length), size)
                data = bytearray(size - header.data_start)
                if f.readinto(data) != len(data):
                    raise UsageError(f"{path} changed while it was read")
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from None
        except CheckpointError as exc:
            raise UsageError(str(exc)) from None
        view = memoryview(data)
        for e in header.entries:
            out.append((e.name, RawTensor(e.dtype, e.shape, view[e.begin : e.end])))
    return out


def run_reload(args: argparse.Namespace) -> int:
    from weightd.client import AdminClient

    creds = _credentials(args)
    target = _target(args, admin=True)
    with AdminClient(target, timeout=args.timeout, credentials=creds) as admin:
        r = admin.reload(args.model)
    print(
        f"reloaded {r.model}: {count(r.num_tensors, 'tensor')}, {r.total_bytes} bytes verified "
        f"in {r.verify_seconds:.2f}s"
    )
    return 0
