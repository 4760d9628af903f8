"""``weightd serve``'s checks that need no socket, run before anything is bound or logged.

The docs promise that a start-up failure prints one line. The daemon itself only
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
import importlib.util
import os
import stat
from collections.abc import Iterator
from dataclasses import replace

from ..base.errors import ManifestSyntaxError, UsageError, WeightdError
from ..config import Loaded, ServeConfig
from ..config.build import local_config, verify_options
from ..daemon.addresses import Address, parse_address
from ..daemon.listeners import admin_address, host_port
from ..daemon.security import TlsFiles, check_admin_listener, check_worker_listener, read_tls
from ..daemon.sockets import already_serving, lock_holder, socket_home
from ..plan.rules_file import load_rules_file
from ..sources.location import default_model_name, is_remote, parse_s3_uri
from ..transports.options import check_config
from ..trust.manifest import MAX_MANIFEST_BYTES, parse_manifest
from ..trust.oms import check_chain_file, is_ec_key, read_signature_file
from ..trust.signing import load_public_key
from ..trust.verify import first_problem, read_operator_file, verify_checkpoint


def check_serve(loaded: Loaded) -> None:
    """Raise the first problem with the config (nothing is created, bound or logged).

    Each message starts with the flag, variable or file key the path was given by.
    """
    config = loaded.config
    _check_listeners(config)
    _check_models(config, loaded.where("model"))
    for path in config.rules:
        load_rules_file(path)  # its errors name the file and the rule, as serve's did
    with _flag(loaded.where("trust.trust_key")):
        for path in config.trust.trust_key:
            if not is_ec_key(path):  # an EC key checks OMS signatures (trust/oms.py)
                load_public_key(path)
    with _flag(loaded.where("trust.trust_chain")):
        for path in config.trust.trust_chain:
            check_chain_file(path)
    with _flag(loaded.where("trust.signature")):
        for path in config.signatures().values():
            if not is_remote(path):  # an s3:// one: read by the source resolver
                read_signature_file(path)
    with _flag(loaded.where("trust.manifest")):
        for path in config.manifests().values():
            if is_remote(path):
                continue  # read (and checked) by the source resolver, before any download
            raw = read_operator_file(path, MAX_MANIFEST_BYTES, ManifestSyntaxError)
            parse_manifest(path, raw)
    for root in config.adapters.root:
        if is_remote(root):
            parse_s3_uri(root)
        else:
            _check_directory(loaded.where("adapters.root"), root)


@contextlib.contextmanager
def _flag(flag: str) -> Iterator[None]:
    """Prefix a parser's error (``PATH: problem``) with the flag that named the file."""
    try:
        yield
    except WeightdError as exc:
        exc.message = f"{flag} {exc.message}"
        raise


def _check_listeners(config: ServeConfig) -> None:
    """The same address, TLS and listener policies ``create_daemon`` applies, dry."""
    group = config.socket_group_access
    address = parse_address(config.listen)
    if address.kind == "unix":  # a directory no socket may go in: refused here, unlogged
        address = Address("unix", path=socket_home(address.path, group=group)[0])
        _check_not_taken(address.path)
    tls = read_tls(TlsFiles(config.tls.cert, config.tls.key, config.tls.client_ca))
    check_worker_listener(address, tls=tls is not None, insecure=config.insecure)
    admin = admin_address(config.admin.listen, address)
    if admin is not None:
        if admin.kind == "unix" and config.admin.listen is not None:
            socket_home(admin.path)
        if admin.kind == "unix":
            _check_not_taken(admin.path)
        check_admin_listener(admin, tls=tls, allowed=frozenset(config.admin.allow))
    if config.health.listen is not None:
        parse_address(config.health.listen)
    if config.metrics.listen is not None:
        host_port(config.metrics.listen)
    check_config(local_config(config), address.kind == "unix")


def _check_not_taken(path: str) -> None:
    """Another daemon on this socket is refused here, before the ``start`` line (the
    daemon takes the lock itself when it binds: this is the early, unlogged answer)."""
    holder = lock_holder(path + ".lock")
    if holder is not None:
        raise already_serving(holder, path)


def _check_models(config: ServeConfig, where: str) -> None:
    remote = [m.value for m in config.model if is_remote(m.value)]
    remote += [r for r in config.adapters.root if is_remote(r)]
    if remote and importlib.util.find_spec("boto3") is None:
        raise UsageError(
            f"{remote[0]}: s3:// sources need boto3 (the s3 extra): pip install boto3, or "
            "pip install '.[s3]' in a clone of weightd"
        )
    # An OMS signature is verified by the load, on a thread beside the hashing (its
    # library's import is slow): here its file was only read above.
    options = replace(verify_options(config), digests=False, progress=False, signatures={})
    for model in config.model:
        if is_remote(model.value):
            parse_s3_uri(model.value)  # a malformed location fails here, in one line
            continue  # checked against the store when the daemon starts
        _check_directory(where, model.value)
        name = model.name or default_model_name(model.value)
        # Every check but the digests (structure, config, layout, manifest):
        # a bad checkpoint is one line before the first log line and the first bind.
        v = verify_checkpoint(model.value, name, options)
        v.store.close()
        if v.problems:
            raise first_problem(v.problems, model.value)


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
