"""``weightd serve``'s checks that need no socket, run before anything is bound or logged.

The README promises that a start-up failure prints one line. The daemon itself only
notices a missing model directory, an unreadable manifest or key, or a bad rules file
once its listeners are bound and its ``start`` and ``listening`` lines are out; a typo
then leaves several INFO lines, a socket directory and lock files behind. So every
argument and every path the command names is checked here first, with the same
functions the daemon uses later (address parsing, the TLS and listener policies, the
manifest, key and rules parsers), and the first problem is raised as one
:class:`~weightd.server.base.errors.WeightdError` naming the flag and the path.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator

from ..base.errors import ManifestSyntaxError, UsageError, WeightdError
from ..daemon.addresses import parse_address
from ..daemon.assembly import ServeConfig
from ..daemon.listeners import admin_address, host_port
from ..daemon.security import TlsFiles, check_admin_listener, check_worker_listener, read_tls
from ..plan.rules_file import load_rules_file
from ..rpc.wire import MAX_CHUNK_BYTES
from ..sources.location import is_remote
from ..transports.options import check_config
from ..trust.manifest import MAX_MANIFEST_BYTES, parse_manifest
from ..trust.signing import load_public_key
from ..trust.verify import read_operator_file


def check_serve(config: ServeConfig, model_names: list[str]) -> None:
    """Raise the first problem with ``config`` (nothing is created, bound or logged).

    ``model_names`` are the names the models will be served under, in order.
    """
    _check_numbers(config)
    _check_listeners(config)
    _check_models(config, model_names)
    for path in config.rules_files:
        load_rules_file(path)  # its errors name the file and the rule, as serve's did
    with _flag("--trust-key"):
        for path in config.verify.trust_keys:
            load_public_key(path)
    with _flag("--manifest"):
        for path in config.verify.manifests.values():
            if is_remote(path):
                continue  # read (and checked) by the source resolver, before any download
            raw = read_operator_file(path, MAX_MANIFEST_BYTES, ManifestSyntaxError)
            parse_manifest(path, raw)
    for root in config.adapter_roots:
        if not is_remote(root):
            _check_directory("--adapter-root", root)


@contextlib.contextmanager
def _flag(flag: str) -> Iterator[None]:
    """Prefix a parser's error (``PATH: problem``) with the flag that named the file."""
    try:
        yield
    except WeightdError as exc:
        exc.message = f"{flag} {exc.message}"
        raise


def _check_numbers(config: ServeConfig) -> None:
    positive = {
        "--max-workers": config.max_workers,
        "--max-concurrent-rpcs": config.max_concurrent_rpcs,
        "--chunk-bytes": config.chunk_bytes,
    }
    if config.adapter_budget_bytes is not None:
        positive["--adapter-budget-bytes"] = config.adapter_budget_bytes
    if config.verify.threads is not None:
        positive["--hash-threads"] = config.verify.threads
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    if config.chunk_bytes > MAX_CHUNK_BYTES:
        raise UsageError(f"--chunk-bytes {config.chunk_bytes}: at most {MAX_CHUNK_BYTES}")
    not_negative = {
        "--grace": config.grace_seconds,
        "--watch-interval": config.watch_seconds,
        "--max-stream-seconds": config.max_stream_seconds,
    }
    for flag, seconds in not_negative.items():
        if not seconds >= 0:  # NaN too
            raise UsageError(f"{flag} {seconds}: must be 0 or more seconds")


def _check_listeners(config: ServeConfig) -> None:
    """The same address, TLS and listener policies ``create_daemon`` applies, dry."""
    address = parse_address(config.listen)
    tls = read_tls(TlsFiles(config.tls_cert, config.tls_key, config.tls_client_ca))
    check_worker_listener(address, tls=tls is not None, insecure=config.insecure)
    admin = admin_address(config.admin_listen, address)
    if admin is not None:
        check_admin_listener(admin, tls=tls, allowed=frozenset(config.admin_allow))
    if config.health_listen is not None:
        parse_address(config.health_listen)
    if config.metrics_listen is not None:
        host_port(config.metrics_listen)
    check_config(config.local, address.kind == "unix")


def _check_models(config: ServeConfig, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise UsageError(
                f"--model: two models named {name!r}; name them apart with --model NAME=DIR"
            )
        seen.add(name)
    for _, directory in config.models:
        if not is_remote(directory):  # checked against the store when the daemon starts
            _check_directory("--model", directory)


def _check_directory(flag: str, path: str) -> None:
    """``path`` is a directory this user can list and read (the loader opens it later)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: is not a directory ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{flag} {path}: is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: this user cannot read the directory")
