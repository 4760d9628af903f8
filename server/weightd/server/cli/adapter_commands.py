"""``weightd adapter load|list|unload|watch|digest``: the operator's side of LoRA adapters.

``load``, ``list`` and ``unload`` call the admin listener (``AdminClient``), ``watch``
the worker listener (what an engine sees); ``digest`` reads a local directory. Like
the other client commands, a failure is one line naming the daemon's reason, and no
daemon at the address is said plainly.
None of them imports torch: adapters are managed without making tensors.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from weightd.common.sockets import default_admin_path, default_socket_path

from ..base.errors import UsageError
from .client_commands import _add_client_tls_args, _add_target, _credentials, _target


def _admin_target(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        dest="target_flag",
        metavar="ADDRESS",
        help="the daemon's admin address: a socket path, unix:///PATH or HOST:PORT "
        f"(default: unix://{default_admin_path()})",
    )


def add_parsers(sub: Any) -> None:
    a = sub.add_parser("adapter", help="load, list, unload or watch LoRA adapters")
    cmds = a.add_subparsers(dest="adapter_command", required=True)

    load = cmds.add_parser(
        "load", help="load (or atomically replace) an adapter from under an adapter root"
    )
    load.add_argument(
        "operands",
        nargs="+",
        metavar="[TARGET] NAME SOURCE",
        help="the adapter's name (what engines ask for) and its directory under an "
        "--adapter-root (or an s3:// prefix under one); a leading admin address is "
        "accepted as --target",
    )
    _admin_target(load)
    load.add_argument("--model", default=None, help="the base model (default: the only one)")
    load.add_argument(
        "--digest", default=None, metavar="sha256:HEX", help="refuse it unless it has this digest"
    )

    ls = cmds.add_parser("list", help="list the loaded adapters")
    _add_target(ls, f"unix://{default_admin_path()}", admin=True)
    ls.add_argument("--json", action="store_true")

    unload = cmds.add_parser("unload", help="unload an adapter (fetches in flight finish)")
    unload.add_argument(
        "operands",
        nargs="+",
        metavar="[TARGET] NAME",
        help="the adapter's name; a leading admin address is accepted as --target",
    )
    _admin_target(unload)

    watch = cmds.add_parser(
        "watch", help="print adapter events as the daemon publishes them (worker address)"
    )
    _add_target(watch, f"unix://{default_socket_path()}")
    watch.add_argument(
        "--count", type=int, default=0, metavar="N", help="stop after N events (0: until Ctrl-C)"
    )
    digest = cmds.add_parser(
        "digest", help="print an adapter directory's digest (what --adapter-digest pins)"
    )
    digest.add_argument("directory")

    for p in (load, ls, unload, watch):
        p.add_argument("--timeout", type=float, default=None, help="seconds per call")
        _add_client_tls_args(p)


def _shown(text: str) -> str:
    """A daemon-supplied string for a terminal line: bare when plain, else quoted."""
    return text if text.isprintable() and " " not in text and text else json.dumps(text)


def _operands(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Spread ``operands`` over ``names``; one more in front is the address (old form)."""
    given: list[str] = args.operands
    if len(given) == len(names) + 1:
        target, *given = given
        if args.target_flag is not None and args.target_flag != target:
            raise UsageError(f"two addresses given: {target!r} and --target {args.target_flag!r}")
        args.target_flag = target
    if len(given) != len(names):
        wanted = " ".join(n.upper() for n in names)
        raise UsageError(f"adapter {args.adapter_command}: expected [TARGET] {wanted}")
    for name, value in zip(names, given, strict=True):
        setattr(args, name, value)


def run_adapter(args: argparse.Namespace) -> int:
    if args.adapter_command == "watch":
        return _watch(args)
    if args.adapter_command == "digest":
        print(directory_digest(args.directory))
        return 0
    from weightd.client.api.admin import AdminClient

    if args.adapter_command == "load":
        _operands(args, ("name", "source"))
    elif args.adapter_command == "unload":
        _operands(args, ("name",))
    if not hasattr(args, "target"):
        args.target = None
    creds = _credentials(args)
    with AdminClient(_target(args, admin=True), timeout=args.timeout, credentials=creds) as admin:
        if args.adapter_command == "load":
            s = admin.load_adapter(
                args.name, args.source, model=args.model, expected_digest=args.digest
            )
            print(
                f"loaded {_shown(s.name)} version {s.version} {s.digest} "
                f"(model {_shown(s.base_model)}, {s.nbytes} bytes) from {_shown(s.source_dir)}"
            )
        elif args.adapter_command == "unload":
            s = admin.unload_adapter(args.name)
            print(f"unloaded {_shown(s.name)} version {s.version} {s.digest}")
        else:
            states = admin.list_adapters()
            if args.json:
                print(json.dumps([s.__dict__ for s in states], indent=2))
            for s in [] if args.json else states:
                held = f"{s.leases} leases" + (", pinned" if s.pinned else "")
                print(
                    f"{_shown(s.name)}\tversion {s.version}\t{s.digest}\t{_shown(s.base_model)}"
                    f"\t{s.nbytes} bytes\t{held}\t{_shown(s.source_dir)}"
                )
    return 0


def directory_digest(directory: str) -> str:
    """The adapter digest of the two files in ``directory``, as the daemon computes it."""
    import hashlib
    import os
    import stat

    from weightd.common.digests import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_digest

    def sha256(name: str) -> str:
        path = os.path.join(directory, name)
        h = hashlib.sha256()
        try:  # one open, checked by descriptor: a FIFO or a directory is one line
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise UsageError(f"{path}: cannot read: {exc.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory
            os.close(fd)
            raise UsageError(f"{path}: is not a regular file")
        with os.fdopen(fd, "rb") as f:
            os.set_blocking(fd, True)
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest()

    return adapter_digest(sha256(ADAPTER_CONFIG_FILE), sha256(ADAPTER_WEIGHTS_FILE))


def _watch(args: argparse.Namespace) -> int:
    from weightd.client import WeightClient

    creds = _credentials(args)
    seen = 0
    with (
        WeightClient(_target(args), credentials=creds) as client,
        client.watch_adapters(timeout=args.timeout) as events,
    ):
        for e in events:
            why = f" ({e.reason})" if e.reason else ""
            print(f"{e.kind} {_shown(e.name)} version {e.version} {e.digest}{why}")
            sys.stdout.flush()
            seen += 1
            if args.count and seen >= args.count:
                break
    return 0
