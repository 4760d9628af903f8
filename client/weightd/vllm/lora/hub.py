"""The API-server side of weightd LoRA in vLLM: a name → a verified version vLLM can load.

vLLM loads a LoRA adapter named by a path (``LoRARequest.lora_path``) in every worker
(``WorkerLoRAManager._load_adapter``), at a step of the engine loop where a failure
would stop the engine. So the weightd side does everything that can fail *before*
vLLM sees the adapter, in the API server process, where a failure is an HTTP error:

1. ``ResolveAdapter``: the daemon's current version of the name (loaded from its
   roots on request, when its operator allows that name);
2. the hand-over, one of two:

   * **shared** (``handover: auto`` and the daemon's side socket on this host, the
     default there): the daemon's sealed pack of the version is leased here (built
     now, its config and digest checked: :func:`.shared.hold_pack`) and vLLM gets a
     path that *names* the version (:func:`.shared.shared_path`); each worker maps
     that one pack and builds the adapter from it (:mod:`.worker`). Nothing is
     written, no byte is streamed, and one copy per host serves every engine and
     rank. This hub's lease keeps the version in the daemon as long as a private
     copy would stay (below), so a worker loading it again later finds it.
   * **files** (another host, or ``handover: files``): ``FetchAdapterFiles``, the
     version's two files exactly as the daemon verified them, written as they arrive
     into a new private directory (0700, this user's; files 0400) and hashed on the
     way; the directory is renamed into place, named after the version
     (``<dir>/<name>@v<version>-<digest prefix>``), only when they give the version's
     digest (the one an operator pins). vLLM's own loader reads it; whoever can write
     that directory can also write the engine's memory (no new trust). Cost: one
     write per version per API server, read again by every worker.

Either way PEFT's settings (rank, alpha, ``rank_pattern``, ``alpha_pattern``, rsLoRA,
target modules) are the daemon's verified ``adapter_config.json``, byte for byte.

**The version is in what vLLM keys on.** ``lora_name`` is ``<name>@v<version>`` and
``lora_path`` names the version (and its digest): vLLM's prefix cache keys a LoRA
request's blocks on ``(lora_name, lora_path)`` (``v1/core/kv_cache_utils.py``), so
blocks of one version are never reused for another; and two versions of one adapter
in one batch stay two adapters (vLLM's worker collects the batch's adapters in a set
keyed by ``lora_name``: two versions under one name would collapse into one).

Concurrent requests for one name share one daemon round trip and one preparation
(single-flight per name, on top of the daemon's own per-name single-flight).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from weightd.client import AdapterStatus, RetryPolicy, RetryStats, WeightClient, WeightdError
from weightd.client.base.retry import call_with_retry
from weightd.common.digests import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, adapter_digest

from ..share.identity import compare
from .options import ENV, LoRAOptions, parse_lora_options
from .refusals import not_written, refused, unavailable
from .shared import (
    PREFIX,
    Closable,
    NoSharedConfig,
    SharedVersion,
    hold_pack,
    shared_path,
    side_channel,
)

log = logging.getLogger("vllm.weightd.lora")

_PLAIN: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class AdapterCopy:
    """One adapter version ready for vLLM to load: ``path`` is its private copy (the
    ``files`` hand-over) or names the daemon's pack of it (``shared``; see the module
    docstring)."""

    name: str
    version: int
    digest: str
    path: str
    prepared_seconds: float = 0.0  # fetching and writing it, 0 when it was ready
    #: ``path`` names the version for the workers to map from the daemon's pack
    #: (:mod:`.shared`): no directory, nothing written here.
    shared: bool = False

    @property
    def lora_name(self) -> str:
        """The name vLLM keys this version on (prefix cache, the batch's adapter set)."""
        return f"{self.name}@v{self.version}"


def _dir_name(name: str, version: int, digest: str) -> str:
    hashed = "adapter-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    plain = name if _PLAIN.match(name) else hashed
    return f"{plain}@v{version}-{digest.removeprefix('sha256:')[:12]}"


@dataclass
class _Retired:
    path: str
    since: float


@dataclass
class LoRAHub:
    """One per API-server process (see :func:`hub`); thread- and task-safe."""

    options: LoRAOptions
    _client: WeightClient | None = None
    _root: str | None = None
    _root_id: tuple[int, int] = (0, 0)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ready: dict[tuple[str, int], AdapterCopy] = field(default_factory=dict)
    _retired: list[_Retired] = field(default_factory=list)
    #: Every private copy this hub made (path -> when, in this hub's order of
    #: preparation), retired ones included. Not the daemon's version numbers: a
    #: restarted daemon numbers its versions from 1 again.
    _paths: dict[str, int] = field(default_factory=dict)
    _seq: int = 0
    _pending: dict[str, asyncio.Future[AdapterCopy]] = field(default_factory=dict)
    #: The side-channel lease on each shared version's pack this hub handed out (path ->
    #: its connection), ended when the version's path is let go (as a copy is removed).
    _leases: dict[str, Closable] = field(default_factory=dict)
    #: The daemon's grants carry no adapter config: files from then on.
    _old_daemon: bool = False
    #: vLLM's base model directory -> "" (it is the daemon's model) or why not.
    _bases: dict[str, str] = field(default_factory=dict)
    #: What asking again while the daemon loads an adapter cost.
    retry_stats: RetryStats = field(default_factory=RetryStats)

    # --- the one call ------------------------------------------------------------------

    async def current(self, name: str, base_dir: str | None = None) -> AdapterCopy:
        """The daemon's current version of ``name``, its private copy written.

        ``base_dir``: vLLM's base model directory, checked once to be the daemon's model
        (an adapter verified against another checkpoint must not be applied to it).
        Raises :class:`.AdapterUnavailable`. Callers that arrive while a call for the
        same name is in flight get that call's answer (one daemon round trip for all).
        """
        pending = self._pending.get(name)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self._current, name, base_dir))
            self._pending[name] = pending
            pending.add_done_callback(lambda _: self._pending.pop(name, None))
        return await asyncio.shield(pending)

    def _current(self, name: str, base_dir: str | None) -> AdapterCopy:
        client = self._connect()
        o = self.options
        try:
            if base_dir is not None:
                self._check_base(client, base_dir, name)
            status = self._resolve(client, name)
            ready = self._ready.get((name, status.version))
            if ready is not None and ready.digest == status.digest:
                if not ready.shared:
                    self.root()  # still ours and private: what it holds is what was verified
                return ready
            if o.handover == "auto" and not self._old_daemon and side_channel(o.target):
                # Same host: the workers map the daemon's sealed pack (no file written);
                # this hub's lease keeps the version while vLLM may load it again.
                started = time.monotonic()
                wanted = SharedVersion(status.name, status.version, status.digest)
                try:
                    lease = hold_pack(o.target, wanted, timeout=o.timeout, max_bytes=o.max_bytes)
                except NoSharedConfig as exc:
                    log.warning("weightd: %s; adapters are handed over as files", exc.detail)
                    self._old_daemon = True
                else:
                    path = shared_path(status.name, status.version, status.digest)
                    return self._publish(status, path, time.monotonic() - started, lease=lease)
        except WeightdError as exc:
            raise unavailable(name, o.target, exc) from None
        except OSError as exc:
            raise not_written(name, exc) from None
        started = time.monotonic()
        try:
            path = self._write(client, status)
        except WeightdError as exc:
            raise unavailable(name, o.target, exc) from None
        except OSError as exc:
            raise not_written(name, exc) from None
        return self._publish(status, path, time.monotonic() - started)

    def _resolve(self, client: WeightClient, name: str) -> AdapterStatus:
        """ResolveAdapter, asked again (with the client's backoff, within ``timeout``)
        while the daemon answers that a load on request is in progress
        (``AdapterLoadPending``): it never keeps a caller waiting on one of its threads
        for long. Any other refusal, an unreachable daemon's included, is raised at once."""
        o = self.options
        pending = RetryPolicy(
            initial_backoff=0.02,
            max_backoff=0.5,
            total_seconds=o.timeout,
            reasons=frozenset({"AdapterLoadPending"}),
        )
        return call_with_retry(
            lambda: client.resolve_adapter(name, model=o.model or None, load=o.load),
            pending,
            self.retry_stats,
        )

    def _check_base(self, client: WeightClient, base_dir: str, name: str) -> None:
        """Refuse every adapter if vLLM's base model is not the daemon's (checked once).

        A base that is not a local directory (a hub id vLLM downloads) cannot be
        compared: it is accepted, and the adapter's own check (its
        ``base_model_name_or_path`` names the daemon's model) is what remains.
        """
        problem = self._bases.get(base_dir)
        if problem is None:
            problem = ""
            if os.path.isdir(base_dir):
                desc = client.describe(self.options.model or None)
                differences = compare(Path(base_dir), desc)
                if differences:
                    problem = (
                        f"the daemon's model {desc.name!r} is not vLLM's base model "
                        f"{base_dir}: " + "; ".join(str(d) for d in differences)
                    )
            self._bases[base_dir] = problem
        if problem:
            raise refused(name, problem)

    # --- the private copies ------------------------------------------------------------

    def _connect(self) -> WeightClient:
        with self._lock:
            if self._client is None:
                self._client = WeightClient(self.options.target, timeout=self.options.timeout)
            return self._client

    def root(self) -> str:
        """This process's private directory (0700), made on first use, removed at exit.

        Checked on every use (:func:`_check_root`): still the very directory made (same
        device and inode), a real directory, this user's, 0700. Its parent (``dir``)
        must be one no other user can replace entries in (:func:`_check_parent`).
        """
        with self._lock:
            if self._root is None:
                parent = self.options.dir or None
                if parent is not None:
                    os.makedirs(parent, mode=0o700, exist_ok=True)
                parent = _check_parent(parent or tempfile.gettempdir())
                root = tempfile.mkdtemp(prefix="weightd-lora-", dir=parent)
                st = os.lstat(root)
                self._root, self._root_id = root, (st.st_dev, st.st_ino)
                atexit.register(_remove_tree, root)
            _check_root(self._root, self._root_id)
            return self._root

    def _write(self, client: WeightClient, status: AdapterStatus) -> str:
        """The version's files, received straight into a new directory, checked against
        its digest, then renamed into place read-only; its path.

        A final directory already there is handed out only once it is verified again
        (:func:`_verified`: ours, read-only, exactly the two files, read without
        following links, hashing to the version's digest); anything else there is
        removed and the version fetched anew.
        """
        root = self.root()
        final = os.path.join(root, _dir_name(status.name, status.version, status.digest))
        if os.path.lexists(final):
            if _verified(final, status.digest):
                return final
            log.warning("weightd: %s is not the verified copy; fetched again", final)
            _remove_tree(final)
        tmp = tempfile.mkdtemp(prefix=".partial-", dir=root)
        try:
            o = self.options
            client.fetch_adapter_files_into(status.name, status.version, tmp, max_bytes=o.max_bytes)
            os.chmod(tmp, 0o500)
            os.rename(tmp, final)
        except BaseException:
            _remove_tree(tmp)
            if _verified(final, status.digest):  # another caller wrote it meanwhile
                return final
            raise
        return final

    def _publish(
        self, status: AdapterStatus, final: str, seconds: float, *, lease: Closable | None = None
    ) -> AdapterCopy:
        shared = lease is not None
        prepared = AdapterCopy(status.name, status.version, status.digest, final, seconds, shared)
        with self._lock:
            if lease is not None:
                old = self._leases.pop(final, None)
                if old is not None:
                    old.close()
                self._leases[final] = lease
            self._ready[(status.name, status.version)] = prepared
            self._seq += 1
            self._paths[final] = self._seq
            expired = self._expired()
        for gone in expired:
            self._let_go(gone)
        if shared:
            log.info(
                "weightd: adapter %r version %d (%s): vLLM's workers map the daemon's pack "
                "(leased and checked in %.3f s)",
                status.name,
                status.version,
                status.digest,
                seconds,
            )
            return prepared
        log.info(
            "weightd: adapter %r version %d (%s) verified and written to %s in %.3f s",
            status.name,
            status.version,
            status.digest,
            final,
            prepared.prepared_seconds,
        )
        return prepared

    def _expired(self) -> list[str]:
        """Copies of superseded versions older than ``retain_seconds`` (under the lock).

        A superseded version is kept that long because requests that started on it
        may still need vLLM to read it again (a worker's adapter cache evicted it).
        """
        now = time.monotonic()
        keep = [r for r in self._retired if now - r.since < self.options.retain_seconds]
        gone = [r.path for r in self._retired if now - r.since >= self.options.retain_seconds]
        self._retired = keep
        for path in gone:
            self._paths.pop(path, None)
        return gone

    def _let_go(self, path: str) -> None:
        """Remove a private copy, or end the lease on a shared version's pack."""
        with self._lock:
            lease = self._leases.pop(path, None)
        if lease is not None:
            lease.close()
        elif not path.startswith(PREFIX):
            _remove_tree(path)

    def owns(self, path: str) -> bool:
        """Whether ``path`` is a private copy this hub made (so its entry is weightd's)."""
        return path in self._paths

    def newer(self, path: str, than: str) -> bool:
        """Whether the copy at ``path`` was prepared after the one at ``than``."""
        return self._paths.get(path, 0) > self._paths.get(than, 0)

    def retire(self, path: str) -> None:
        """vLLM no longer gives new requests the copy at ``path`` (a newer version took
        its place, or the adapter is gone): it is removed ``retain_seconds`` from now,
        since requests that started on it may need vLLM to read it again meanwhile.
        Copies vLLM still serves are never retired, so never removed."""
        with self._lock:
            if path not in self._paths:
                return
            self._retired.append(_Retired(path, time.monotonic()))
            for key, ready in list(self._ready.items()):
                if ready.path == path:
                    del self._ready[key]
            expired = self._expired()
        for gone in expired:
            self._let_go(gone)


class UnsafeDirectory(OSError):
    """The hub's directory, or its parent, is one another user could have written."""


def _check_parent(parent: str) -> str:
    """``parent`` without links, once no other user could swap the hub's directory in it.

    Every directory from ``/`` down to it (links resolved first, so the paths handed to
    vLLM hold none) must be owned by this user or root, and writable by no one else
    unless sticky (as ``/tmp`` is: there, no one else can rename or remove what this
    user made). An ancestor another user can write would let them rename the whole
    branch away and put their own in its place after the hub checked it.
    """
    real = os.path.realpath(parent)
    path = "/"
    for part in [""] + [p for p in real.split("/") if p]:
        path = os.path.join(path, part)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeDirectory(f"LoRA dir {parent}: {path} is not a directory")
        if st.st_uid not in (os.geteuid(), 0):
            raise UnsafeDirectory(
                f"LoRA dir {parent}: {path} is owned by uid {st.st_uid}, not this user or root"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeDirectory(
                f"LoRA dir {parent}: other users can write {path} "
                f"({stat.filemode(st.st_mode)}) and it is not sticky: give a directory "
                "only this user can write"
            )
    return real


def _check_root(root: str, identity: tuple[int, int]) -> None:
    """Refuse the hub's directory unless it is still the one made: same device and
    inode, a real directory, this user's, 0700."""
    st = os.lstat(root)
    if (
        (st.st_dev, st.st_ino) != identity
        or not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.geteuid()
        or stat.S_IMODE(st.st_mode) & 0o077
    ):
        raise UnsafeDirectory(f"LoRA dir {root}: replaced or opened up since this hub made it")


def _verified(final: str, digest: str) -> bool:
    """Whether ``final`` is a copy this user wrote of the version with ``digest``: a real
    directory of this user's that no one else may write, holding exactly the two files,
    each a regular file of this user's with one link, read through the directory's
    descriptor without following links, and together hashing to ``digest``."""
    try:
        dfd = os.open(final, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o277:
            return False
        if sorted(os.listdir(dfd)) != sorted((ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)):
            return False
        hexes = [_file_sha256(dfd, name) for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)]
    except OSError:
        return False
    finally:
        os.close(dfd)
    return None not in hexes and adapter_digest(hexes[0] or "", hexes[1] or "") == digest


def _file_sha256(dfd: int, name: str) -> str | None:
    """SHA-256 of ``name`` in the directory ``dfd`` if it is this user's regular,
    read-only, singly linked file (opened without following a link), else None."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_nlink != 1
            or stat.S_IMODE(st.st_mode) & 0o277
        ):
            return None
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _remove_tree(path: str) -> None:
    """Remove a private copy (its directories are read-only: made writable first)."""
    for top, dirs, _ in os.walk(path):
        for d in [top, *(os.path.join(top, x) for x in dirs)]:
            if os.path.islink(d):
                continue  # never chmod through a link
            with contextlib.suppress(OSError):
                os.chmod(d, stat.S_IRWXU)
    shutil.rmtree(path, ignore_errors=True)


_HUB: list[LoRAHub] = []
_HUB_LOCK = threading.Lock()


def hub() -> LoRAHub:
    """This process's hub, configured from ``WEIGHTD_LORA`` on first use."""
    with _HUB_LOCK:
        if not _HUB:
            _HUB.append(LoRAHub(parse_lora_options(os.environ.get(ENV))))
        return _HUB[0]
