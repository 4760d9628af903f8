"""The ``weightd`` command line. Failures print one line, never a traceback.

This file registers every command, dispatches, and runs the local ones (``serve``,
``plan``, ``demo-checkpoint``); the commands that are clients of a running daemon
are in ``client_commands``, the trust commands in ``trust_commands``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from ..base.errors import WeightdError
from ..config import Named
from ..telemetry.logs import one_line
from .adapter_commands import add_parsers as add_adapter_parsers
from .adapter_commands import run_adapter
from .client_commands import (
    add_fetch_parser,
    run_describe,
    run_fetch,
    run_health,
    run_list,
    run_publish,
    run_reload,
)
from .client_commands import add_parsers as add_client_parsers
from .config_commands import add_parsers as add_config_parsers
from .config_commands import run_config
from .serve_options import add_config_arguments, given_flags
from .trust_commands import add_parsers as add_trust_parsers
from .trust_commands import run_manifest, run_verify

log = logging.getLogger("weightd")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightd", description="Serve verified per-rank slices of model checkpoints."
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="run the daemon",
        description="Run the daemon. Every option below can also be set in the --config "
        "TOML file or a WEIGHTD_* variable; `weightd config show` prints the result.",
    )
    add_config_arguments(s)

    add_fetch_parser(sub)

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
    pl.add_argument(
        "--vocab-pad",
        type=int,
        default=0,
        metavar="N",
        help="cut vocabulary-parallel tensors as vLLM pads them to a multiple of N "
        "(vLLM: 64); default 0: equal blocks",
    )
    pl.add_argument("--rules", action="append", default=[], metavar="FILE")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--tensors", action="store_true", help="list every rank's tensors")

    add_client_parsers(sub)
    add_adapter_parsers(sub)

    demo = sub.add_parser(
        "demo-checkpoint", help="create (if needed) and print the demo checkpoint"
    )
    demo.add_argument("--cache-dir", default=None)
    add_trust_parsers(sub)
    add_config_parsers(sub)
    return p


def _version() -> str:
    """The installed distribution's version: declared once, in pyproject.toml."""
    from importlib import metadata

    try:
        return metadata.version("weightd")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _plan(args: argparse.Namespace) -> int:
    from ..plan.report import run_plan

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
            vocab_pad=args.vocab_pad,
        )
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ..config.load import check, load
    from ..daemon.assembly import serve
    from ..sources.location import default_model_name
    from ..telemetry.logs import setup_logging
    from .demo import DEMO_NAME, ensure_demo_checkpoint
    from .preflight import check_serve

    loaded = load(given_flags(args), dict(os.environ), args.config)
    config = loaded.config
    names = config.model_names(default_model_name) or [DEMO_NAME]
    # Everything the config names is checked before a socket is bound or a line
    # logged: a typo is one line, and leaves no socket directory behind.
    check(loaded, names)
    check_serve(loaded)
    setup_logging(config.log_level, json_lines=config.log_json)
    if not config.model:
        path = ensure_demo_checkpoint(config.cache_dir)
        log.info("no --model given: serving the built-in demo checkpoint at %s", path)
        config.model = (Named(DEMO_NAME, path),)
    return serve(config)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..telemetry.logs import setup_logging

    if args.command != "serve":  # serve sets up logging from its config, once loaded
        setup_logging("INFO", json_lines=False)
    # Only the client commands import the client (and fetch torch, to make tensors):
    # verify, manifest, serve, list and describe start seconds faster without it.
    explained: tuple[type[Exception], ...] = (WeightdError,)
    if args.command in ("fetch", "list", "describe", "health", "reload", "adapter", "publish"):
        from weightd.client.base.errors import WeightdError as ClientError

        explained = (WeightdError, ClientError)

    try:
        status = _dispatch(args)
        sys.stdout.flush()  # here, not at exit, where a closed pipe cannot be caught
        return status
    except BrokenPipeError:
        return _output_closed()
    except explained as exc:
        print(f"weightd {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"weightd {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(args)
    if args.command == "fetch":
        return run_fetch(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "list":
        return run_list(args)
    if args.command == "describe":
        return run_describe(args)
    if args.command == "health":
        return run_health(args)
    if args.command == "reload":
        return run_reload(args)
    if args.command == "adapter":
        return run_adapter(args)
    if args.command == "publish":
        return run_publish(args)
    if args.command == "verify":
        return run_verify(args)
    if args.command == "manifest":
        return run_manifest(args)
    if args.command == "config":
        return run_config(args)
    print(_demo_path(args))
    return 0


def _output_closed() -> int:
    """Whoever read our output stopped (``weightd describe ... | head``): exit quietly.

    What is still buffered can never be written; stdout is pointed at /dev/null so the
    interpreter's final flush does not print a second complaint. The status is a shell's
    for a process ended by SIGPIPE, so ``set -o pipefail`` still sees the cut.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _demo_path(args: argparse.Namespace) -> str:
    from ..config import load
    from .demo import ensure_demo_checkpoint

    flags = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    return ensure_demo_checkpoint(load(flags, dict(os.environ)).config.cache_dir)


if __name__ == "__main__":
    sys.exit(main())
