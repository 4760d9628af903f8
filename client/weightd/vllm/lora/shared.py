"""The same-host hand-over of an adapter version to vLLM's workers: the daemon's sealed pack.

Where the daemon's side socket is on this host, the hub gives vLLM a ``lora_path`` that
*names* a verified adapter version (:func:`shared_path`) instead of a directory of
files, and each worker that loads it (:mod:`.worker`) maps the daemon's sealed memfd of
that version's whole adapter (its tensor-parallel size 1 pack: one pack per host serves
every engine and every rank, since vLLM's LoRA layers cut per rank themselves) and
builds vLLM's ``LoRAModel`` from tensors viewing that mapping. No file is written and
no byte goes through a gRPC stream.

What is checked before vLLM sees a byte (:func:`map_adapter`):

* the grant is for the version the path names (``AcquirePack.adapter_version``: a
  version a request was given is served while the daemon holds it, even after a
  replace) and its digest is the one in the path;
* ``adapter_config.json`` (carried whole in the grant) and the weights file's SHA-256
  give that digest (:func:`~weightd.common.digests.adapter_digest`, the digest an
  operator pins): PEFT's settings are the daemon's verified file, byte for byte;
* the memfd is sealed and every tensor re-hashed against its slice digest in the grant
  (``verify=True``), as any shared-memory fetch can ask. Where this process has
  ``blake3`` that is BLAKE3, the pack's own kind (cheaper than SHA-256): the
  daemon took those digests at load from the same immutable bytes whose SHA-256 is the
  ``weights_sha256`` checked above, so a mapping that hashes to them holds exactly the
  bytes the digest in the path names (a cryptographic hash either way).

The tensors view the pack (copy-on-write private mapping: vLLM's in-place scaling of
``lora_b`` copies the pages it writes, never the daemon's); the side-channel lease, and
with it the daemon's hold on the version, lasts while any of them lives (vLLM's
CPU-side adapter cache), and ends when vLLM drops the adapter.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import quote, unquote

from weightd.client import DataLossError, FailedPreconditionError
from weightd.client.base.request import Delivery
from weightd.client.receive.hashers import available_kinds
from weightd.client.transports.local import LocalConnection
from weightd.client.transports.localwire import Grant
from weightd.client.transports.selection import side_socket_path
from weightd.client.transports.shm import map_host_pack
from weightd.common.digests import adapter_digest
from weightd.v1 import local_pb2 as lpb
from weightd.v1 import weightd_pb2 as pb

if TYPE_CHECKING:
    import torch


class Closable(Protocol):
    def close(self) -> None: ...


#: The start of a ``lora_path`` naming a weightd adapter version (absolute, so vLLM's
#: ``get_adapter_absolute_path`` passes it on untouched; never a directory that exists).
PREFIX: Final = "/weightd-adapter:"
PEFT_PREFIX: Final = "base_model.model."
_PATH: Final = re.compile(r"^/weightd-adapter:([^/]+)@v([1-9][0-9]{0,18})/sha256:([0-9a-f]{64})$")


class NoSharedConfig(FailedPreconditionError):
    """The daemon predates the shared hand-over (its grants carry no adapter config):
    the hub then hands the version over as files."""


@dataclass(frozen=True)
class SharedVersion:
    """An adapter version as a ``lora_path`` names it."""

    name: str
    version: int
    digest: str  # "sha256:<hex>"


def shared_path(name: str, version: int, digest: str) -> str:
    """The ``lora_path`` naming ``version`` of adapter ``name`` (its digest included, so
    vLLM's prefix cache, keyed on the path, never shares a block between two versions
    or two daemons' different contents)."""
    return f"{PREFIX}{quote(name, safe='')}@v{version}/{digest}"


def parse_shared_path(path: str) -> SharedVersion | None:
    """The version ``path`` names, or None when it is not a weightd shared path."""
    if not path.startswith(PREFIX):
        return None
    m = _PATH.match(path)
    if m is None:
        raise FailedPreconditionError(
            f"LoRA path {path[:200]!r} starts with {PREFIX!r} but does not name a weightd "
            "adapter version (<name>@v<version>/sha256:<hex>)"
        )
    return SharedVersion(unquote(m.group(1)), int(m.group(2)), "sha256:" + m.group(3))


def side_channel(target: str) -> str | None:
    """The daemon's side socket at ``target`` when it is on this host, else None."""
    side = side_socket_path(target)
    return side if side is not None and os.path.exists(side) else None


@dataclass
class SharedAdapter:
    """A verified adapter version mapped from the daemon's pack."""

    version: SharedVersion
    config: dict[str, Any]  # adapter_config.json, parsed (the daemon's verified bytes)
    #: Views of the sealed pack (the lease lives with them), named as in the file.
    tensors: dict[str, torch.Tensor]
    pack_id: int
    built: bool  # this acquire built the pack (False: another process had it built)


def hold_pack(target: str, wanted: SharedVersion, *, timeout: float, max_bytes: int) -> Closable:
    """Lease the pack of ``wanted`` without mapping it; close the result to let it go.

    The API server's hub does this before it gives vLLM the path: the pack is built,
    the version's config and digest are checked, and any refusal is the request's HTTP
    error, all before vLLM's worker asks; and while the hub holds the lease the daemon
    keeps the version (and its pack), so a worker that loads it again later (its
    adapter cache evicted it, inside an engine step) finds it, as the private copy of
    the ``files`` hand-over stays on disk (``retain_seconds``).
    """
    conn, grant, fds = _acquire(target, wanted, timeout)
    try:
        _checked(wanted, grant.adapter, grant.size_bytes, max_bytes)
    except BaseException:
        conn.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return conn


def _acquire(
    target: str, wanted: SharedVersion, timeout: float
) -> tuple[LocalConnection, Grant, list[int]]:
    side = side_channel(target)
    if side is None:
        raise FailedPreconditionError(
            f"weightd adapter {wanted.name!r}: the daemon's side socket for {target} is not "
            "on this host, so its shared pack cannot be mapped here; give this engine "
            'WEIGHTD_LORA with "handover": "files"'
        )
    conn = LocalConnection(side, "shm", timeout)
    try:
        request = lpb.LocalRequest(
            acquire=lpb.AcquirePack(
                adapter=wanted.name,
                adapter_version=wanted.version,
                layout=pb.Layout(tp_size=1, tp_rank=0),
                placement=lpb.PLACEMENT_HOST,
                slice_digests=list(available_kinds()),
            )
        )
        grant, fds = conn.request(request, max_fds=1)
    except BaseException:
        conn.close()
        raise
    return conn, grant, fds


def map_adapter(
    target: str, wanted: SharedVersion, *, timeout: float, max_bytes: int
) -> SharedAdapter:
    """Map and verify the pack of ``wanted`` from the daemon at ``target`` (see the module
    docstring). Raises the daemon's typed errors (:class:`~weightd.client.WeightdError`)."""
    conn, grant, fds = _acquire(target, wanted, timeout)
    try:
        config = _checked(wanted, grant.adapter, grant.size_bytes, max_bytes)
        if len(fds) != 1:
            raise DataLossError(
                f"weightd adapter {wanted.name!r}: a shared-memory grant came with "
                f"{len(fds)} descriptors, not 1"
            )
        fd = fds.pop()
    except BaseException:
        for fd in fds:
            os.close(fd)
        conn.close()
        raise
    # Takes the descriptor and the connection: the lease ends when the views are gone.
    views = map_host_pack(grant, fd, conn, Delivery(transport="shm", verify=True))
    # The daemon serves PEFT's names without PEFT's prefix (every tensor of an adapter it
    # verified has it): named back as in adapter_model.safetensors, as vLLM reads them.
    tensors = {PEFT_PREFIX + n: t for n, t in views.items()}
    return SharedAdapter(wanted, config, tensors, grant.pack_id, grant.built)


def _checked(
    wanted: SharedVersion, raw_info: bytes | None, size: int, max_bytes: int
) -> dict[str, Any]:
    """The grant's adapter config, once the grant is proven to be ``wanted``'s."""
    name = wanted.name
    if raw_info is None:
        raise DataLossError(f"weightd adapter {name!r}: the grant names no adapter version")
    info = pb.AdapterInfo.FromString(raw_info)
    if (info.name, info.version, info.digest) != (name, wanted.version, wanted.digest):
        raise DataLossError(
            f"weightd adapter {name!r}: asked for version {wanted.version} ({wanted.digest}), "
            f"the daemon granted {info.name!r} version {info.version} ({info.digest})"
        )
    if size > max_bytes:
        raise DataLossError(
            f"weightd adapter {name!r}: its pack is {size} bytes, over max_bytes {max_bytes}"
        )
    if not info.config or not info.weights_sha256:
        raise NoSharedConfig(
            f"weightd adapter {name!r}: the daemon's grant carries no adapter config (a daemon "
            'before the shared hand-over): give WEIGHTD_LORA "handover": "files"'
        )
    got = adapter_digest(hashlib.sha256(info.config).hexdigest(), info.weights_sha256)
    if got != wanted.digest:
        raise DataLossError(
            f"weightd adapter {name!r} version {wanted.version}: its config and weights "
            f"hash to {got}, not {wanted.digest}"
        )
    try:
        config = json.loads(info.config)
    except ValueError as exc:
        raise DataLossError(f"weightd adapter {name!r}: adapter_config.json: {exc}") from None
    if not isinstance(config, dict):
        raise DataLossError(f"weightd adapter {name!r}: adapter_config.json is not an object")
    return config


__all__ = [
    "PREFIX",
    "NoSharedConfig",
    "SharedAdapter",
    "SharedVersion",
    "hold_pack",
    "map_adapter",
    "parse_shared_path",
    "shared_path",
    "side_channel",
]
