"""``weight_transfer_config={"backend": "weightd"}``: running engines move to a new version.

vLLM 0.32's weight-transfer plug point (``vllm/distributed/weight_transfer/``) runs one
engine object per worker; the engine's ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` (Python: ``LLM``'s methods of the same names; HTTP: the
``/start_weight_update`` ... routes) call it on every worker through vLLM's
``collective_rpc``. With this backend an update names a version the daemon serves::

    llm.start_weight_update()
    llm.update_weights({"update_info": {"model": "llama", "version": 7}})
    llm.finish_weight_update(weight_version="7")

and ``update_weights`` does, on every worker, all or nothing:

1. **hold**: the worker takes a hold on that version in the daemon (``HoldVersion``,
   with a TTL covering the update) and asks for its description, which must have the
   tensor names, dtypes and shapes of the engine's checkpoint (``shapes.py``); the
   engine must be one an update in place can bring to a fresh engine's state
   (``presharded.shared_problems``). Every rank reports to every other (vLLM's CPU
   process group) its outcome and what it would take (:class:`Staged`: model, version
   number, :func:`content_digest`); if any rank failed, or the ranks would take other
   content (per-rank ``update_info`` may name another daemon per host, never other
   weights), every rank raises the same error and nothing was fetched. From here on
   the version stays in the daemon whatever is published meanwhile.
2. **stage**: each worker fetches only its own share of the version (its TP/PP layout,
   vLLM's vocabulary padding; shared memory on the daemon's host, gRPC otherwise),
   beside the running model: over gRPC every slice is checked against the daemon's
   digest as it arrives (into memory of its own); over shared memory the share is a
   view of the daemon's sealed pack, whose every byte the daemon checked against the
   verified digests as it built it (``verify`` re-hashes it here too). Again every
   rank reports; if any rank could not fetch or verify its
   share, every rank raises one error naming the failing rank(s), the model and the
   version, drops what it staged, and the engine keeps its weights, untouched.
3. **apply**: only when every rank staged its whole share, each loads it in place
   through vLLM's own ``model.load_weights`` inside vLLM's layer-wise reload (which
   re-runs each layer's post-processing, e.g. the CPU GEMM repacking), so fused,
   padded and repacked parameters stay vLLM's code (``presharded.py``). The modules
   the reload leaves idle that share a parameter with one it loaded (a tied
   ``lm_head``) are post-processed again after it, as a fresh start does
   (``presharded.reprocess_shared``): after an update every parameter, and what every
   layer computes with, equals a fresh engine's on that version.

Everything happens inside the one ``update_weights`` call, which vLLM's engine runs on
every worker between two scheduler steps: no step sees some ranks on the old version
and others on the new. A request already running across the update sees the old
weights for its earlier tokens (pause generation first, as for every backend). The
hold is released once every rank staged (or failed).

``finish_weight_update(weight_version=...)`` is where vLLM records the engine's
version: pass the daemon's number (:func:`weightd.vllm.transfer.rl.update_llm` does).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from weightd.client import Layout, ModelDescription, Transport, WeightClient, WeightdError
from weightd.client.base.errors import PackPendingError
from weightd.client.base.request import Wanted
from weightd.client.receive.hashers import available_kinds
from weightd.client.transports.local import LocalConnection
from weightd.client.transports.localwire import PLACEMENT_HOST, encode_acquire
from weightd.client.transports.selection import side_socket_path
from weightd.common.sockets import default_target

from ..errors import WeightdLoadError, WeightdUpdateError
from ..settings import Settings
from ..share.fetch import LoadReport, Weights, fetch_share
from ..share.placement import worker_layout
from ..share.presharded import (
    idle_modules,
    presharded_reloading,
    reprocess_shared,
    shared_problems,
)
from ..share.vocab import padded_layout
from .shapes import differences

log = logging.getLogger("vllm.weightd")

#: Seconds a worker's calls to the daemon may take, when the update does not say.
DEFAULT_TIMEOUT = 300.0
#: Seconds at most that announcing a layout at init may take (it never fails the init).
ANNOUNCE_TIMEOUT = 10.0
#: Added to the timeout for the hold's TTL: it must outlive the slowest rank's fetch.
HOLD_MARGIN = 60.0
_TRANSPORTS: tuple[str, ...] = ("auto", "grpc", "shm")

__all__ = ["WeightdUpdateError", "WeightdWeightTransferEngine"]


def _check(where: str, info: WeightdInitInfo | WeightdUpdateInfo) -> None:
    """The keys an engine's and an update's info share, by weightd's one settings rule."""
    keys = ("model", "target", "transport", "timeout")
    s = Settings(where, {key: getattr(info, key) for key in keys})
    s.text("model")
    if info.target is not None:
        s.target()
    s.choice("transport", _TRANSPORTS, "auto")
    s.seconds("timeout")


@dataclass
class WeightdInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """Defaults for every update (``init_weight_transfer_engine``; optional)."""

    target: str | None = None
    model: str | None = None
    transport: str = "auto"
    timeout: float | None = None

    def __post_init__(self) -> None:
        _check("init_info", self)


@dataclass
class WeightdUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """One update: the model and the version the daemon serves (``VersionInfo.version``).

    ``target``, ``model``, ``transport``, ``timeout`` override the init info; vLLM also
    accepts a list with one dict per worker (by global rank), e.g. another target each.
    """

    version: int = 0
    model: str | None = None
    target: str | None = None
    transport: str | None = None
    timeout: float | None = None
    #: Also re-hash a shared-memory share against the pack's digests. Off by default:
    #: the daemon checked every byte against the verified digests as it built the pack,
    #: which is a sealed memfd nobody can change since (``weightd.client.transports.shm``); a gRPC
    #: share is always checked as it arrives.
    verify: bool = False

    def __post_init__(self) -> None:
        s = Settings("update_info", {"version": self.version, "verify": self.verify})
        s.version()
        s.flag("verify", False)
        _check("update_info", self)


@dataclass
class UpdateReport:
    """What one worker's latest update did (for tests, benchmarks and the log)."""

    model: str
    version: int
    rank: int
    ok: bool = False
    error: str = ""
    hold_seconds: float = 0.0
    stage_seconds: float = 0.0
    apply_seconds: float = 0.0
    share: LoadReport | None = None


def content_digest(desc: ModelDescription) -> str:
    """One digest of a version's whole content, from its description's verified digests.

    Every tensor's name, dtype, shape and verified digest, in name order: two daemons
    serving the same bytes give the same value whatever their version numbers, paths or
    shard files, and a rank's staged share is checked against those digests as it
    arrives (gRPC) or as the daemon built its pack (shared memory).
    """
    h = hashlib.sha256()
    for t in sorted(desc.tensors, key=lambda t: t.name):
        h.update(f"{t.name}\0{t.dtype}\0{list(t.shape)}\0{t.digest}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Staged:
    """What one rank takes: every rank of an update must take the same."""

    model: str
    version: int
    content: str  # :func:`content_digest`

    def __str__(self) -> str:
        return f"model {self.model!r} version {self.version} (content {self.content[:12]})"


def announce_layout(target: str, model: str, layout: Layout, timeout: float) -> str:
    """Ask the daemon at ``target`` for ``layout``'s host pack of ``model`` without waiting,
    and let it go at once; what happened, in words (never raises).

    The daemon answers a pack it has (a lease, ended here by closing the connection and
    the descriptor) or starts building it in the background (``no_wait``: PackPending);
    either way it remembers the layout, so later publishes prepare its pack.
    """
    side = side_socket_path(target)
    if side is None or not os.path.exists(side):
        return "no side channel there (a TCP target, or no daemon): nothing prepared ahead"
    try:
        conn = LocalConnection(side, "shm", timeout)
    except (WeightdError, OSError) as exc:
        return f"not reached ({exc}): nothing prepared ahead"
    try:
        request = encode_acquire(
            Wanted(layout=layout, model=model),
            placement=PLACEMENT_HOST,
            slice_digests=available_kinds(),
            no_wait=True,
        )
        try:
            _, fds = conn.request(request, max_fds=1)
        except PackPendingError:
            return "its pack is being built"
        except (WeightdError, OSError) as exc:
            return f"refused ({exc}): nothing prepared ahead"
        for fd in fds:
            os.close(fd)
        return "its pack is built"
    finally:
        conn.close()


def _creating_worker() -> Any:
    """The vLLM ``Worker`` whose ``load_model`` is creating this engine, or None.

    Found by walking up the creating frames to the object that has the worker's update
    session flag (``Worker._weight_update_active``, vLLM 0.32's ``v1/worker/gpu_worker.py``,
    which the CPU worker inherits): see :meth:`WeightdWeightTransferEngine.update_weights`
    for why a rank must end its session itself. None (every rank then raises) when the
    structure is not the one expected.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if hasattr(candidate, "_weight_update_active") and hasattr(candidate, "model_runner"):
            return candidate
        frame = frame.f_back
    return None


def _all_gather(obj: Any) -> list[Any]:
    """``obj`` of every rank of this engine, in rank order (vLLM's CPU process group)."""
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return [obj]
    out: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(out, obj, group=group.cpu_group)
    return out


class WeightdWeightTransferEngine(
    WeightTransferEngine[WeightdInitInfo, WeightdUpdateInfo]  # type: ignore[misc]
):
    """The ``weightd`` backend; see the module docstring."""

    init_info_cls = WeightdInitInfo
    update_info_cls = WeightdUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._worker = _creating_worker()
        self.defaults = WeightdInitInfo()
        #: The daemon version these weights are (0: what the engine started with).
        self.version = 0
        #: The latest update's report.
        self.last: UpdateReport | None = None
        self._holder = f"vllm-{getattr(self.vllm_config, 'instance_id', '') or 'engine'}"

    def init_transfer_engine(self, init_info: WeightdInitInfo) -> None:
        """Keep the defaults, and make this rank's layout known to the daemon now.

        Why: an engine that loaded from disk (vLLM's own loader) never asked the daemon
        for anything, so the daemon built no pack of its layout, and its first update
        built one on the way (seconds: most of that update). Asked once here, without
        waiting, the daemon starts building the pack of the current version in the
        background and remembers the layout; every later publish prepares that
        layout's pack before it says ready. Best effort: a daemon that cannot be
        reached now costs a warning, not the engine.
        """
        self.defaults = init_info  # checked as it was made (``_check``)
        d = init_info
        target = d.target or default_target()
        layout = padded_layout(worker_layout(self.model_config), self.model)
        said = announce_layout(
            target, d.model or "", layout, min(d.timeout or ANNOUNCE_TIMEOUT, ANNOUNCE_TIMEOUT)
        )
        log.info("weightd: layout %s made known to %s: %s", layout.describe(), target, said)

    def start_weight_update(self) -> None:
        """Nothing to prepare: each update stages aside, then applies in one step."""

    def finish_weight_update(self) -> None:
        """Nothing left: ``update_weights`` applied the version on every rank, or none."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """:meth:`receive_weights`; a failure is raised by the engine's last rank only.

        Why: vLLM's multiprocess executor reads the workers' replies in rank order and
        raises at the first failure, leaving the later ranks' replies queued, where the
        engine's next ``collective_rpc`` reads them as its own (``get_response`` in
        ``v1/executor/multiproc_executor.py``): after a failure raised on every rank,
        every later call to every worker of a TP=2 engine failed. Every rank knows the
        outcome (they agreed on it), so the others end their update session as vLLM
        would have on an error (``Worker.update_weights``) and return; the last rank
        raises the one error, which the engine reports.
        """
        from vllm.distributed.parallel_state import get_world_group

        group = get_world_group()
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except WeightdUpdateError:
            worker = self._worker
            if group.rank_in_group == group.world_size - 1 or worker is None:
                raise
            worker._weight_update_active = False
            self.reset_weight_update_target()
            return
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def shutdown(self) -> None:
        """No connection outlives an update."""

    # --- the update -----------------------------------------------------------------------

    def receive_weights(self, update_info: WeightdUpdateInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank_in_group
        d = self.defaults
        target = update_info.target or d.target or default_target()
        model_name = update_info.model or d.model or ""
        transport: Transport = update_info.transport or d.transport or "auto"  # type: ignore[assignment]
        timeout = update_info.timeout or d.timeout or DEFAULT_TIMEOUT
        version = update_info.version
        layout = padded_layout(worker_layout(self.model_config), self.model)
        report = UpdateReport(model_name or "(the daemon's only model)", version, rank)
        self.last = report
        where = f"rank {rank} ({layout.describe()}, weightd at {target})"
        what = f"model {report.model!r} version {version}"

        with WeightClient(target, timeout=timeout) as client:
            # 1. hold the version and check its shapes, on every rank
            started = time.perf_counter()
            hold = None
            problem = ""
            desc = None
            staged: Staged | None = None
            try:
                hold = client.hold_version(
                    model_name, version, holder=self._holder, ttl=timeout + HOLD_MARGIN
                )
                desc = client.describe(model_name, version=version)
                report.model = desc.name
                what = f"model {desc.name!r} version {version}"
                staged = Staged(desc.name, version, content_digest(desc))
                changed = differences(Path(self.model_config.model), desc)
                if changed:
                    problem = (
                        "its shapes differ from the engine's checkpoint "
                        f"({self.model_config.model}): " + "; ".join(changed)
                    )
                elif unfit := shared_problems(self.model):
                    problem = (
                        "this engine cannot be brought to a fresh engine's weights in "
                        "place: " + "; ".join(unfit) + " (restart it on the new checkpoint)"
                    )
            except (WeightdError, WeightdLoadError, OSError, ValueError) as exc:
                problem = str(exc)
            report.hold_seconds = time.perf_counter() - started
            try:
                self._agree("refused before any rank fetched a byte", what, where, problem, staged)
                # 2. stage: every rank fetches and verifies its whole share, aside
                started = time.perf_counter()
                weights: Weights = []
                try:
                    assert desc is not None
                    weights, report.share = fetch_share(
                        client,
                        desc,
                        layout,
                        self.model,
                        transport=transport,
                        version=version,
                        verify=update_info.verify,
                    )
                except (WeightdError, WeightdLoadError, OSError, ValueError) as exc:
                    problem = str(exc)
                report.stage_seconds = time.perf_counter() - started
                self._agree("no rank applied it", what, where, problem, staged)
            finally:
                if hold is not None:
                    hold.release()
        # 3. apply, every rank: all of them staged their whole share
        started = time.perf_counter()
        try:
            self._apply(weights)
        except Exception as exc:  # vLLM's loaders raise what they raise
            log.exception("weightd: %s could not apply %s", where, what)
            problem = f"{type(exc).__name__}: {exc}"
        del weights
        report.apply_seconds = time.perf_counter() - started
        self._agree(
            "some ranks may have applied it: the engine's weights are inconsistent, restart it",
            what,
            where,
            problem,
        )
        self.version = version
        report.ok = True
        log.info(
            "weightd: %s updated in place to %s: hold %.2fs, stage %.2fs (%.1f MiB over %s), "
            "apply %.2fs",
            where,
            what,
            report.hold_seconds,
            report.stage_seconds,
            (report.share.bytes if report.share else 0) / 2**20,
            report.share.transport if report.share else "",
            report.apply_seconds,
        )

    def _agree(
        self, consequence: str, what: str, where: str, problem: str, staged: Staged | None = None
    ) -> None:
        """Every rank's outcome to every rank; raise on all of them if any failed.

        With ``staged``, the ranks must also take the same content: the same model,
        version number and :func:`content_digest` (per-rank ``update_info`` may send
        ranks to other daemons, never to other weights). Otherwise every rank raises,
        naming what each rank would take.
        """
        outcomes = _all_gather((where, problem, staged))
        failed = [(w, p) for w, p, _ in outcomes if p]
        keeps = f"the engine keeps version {self.version or 'it started with'}"
        if failed:
            detail = "; ".join(f"{w}: {p}" for w, p in failed)
            message = (
                f"weightd: update to {what} failed on {len(failed)} of {len(outcomes)} "
                f"rank(s) ({consequence}; {keeps}): {detail}"
            )
        elif staged is not None and len({s for _, _, s in outcomes}) > 1:
            detail = "; ".join(f"{w} takes {s}" for w, _, s in outcomes)
            message = (
                "weightd: update refused on every rank: the ranks would take different "
                f"content ({consequence}; {keeps}): {detail}"
            )
        else:
            return
        if self.last is not None:
            self.last.error = message
        log.warning("%s", message)  # this rank's one line (vLLM's traceback is filtered)
        raise WeightdUpdateError(message)

    def _apply(self, weights: Weights) -> None:
        """Load the staged share in place through vLLM's layer-wise reload."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        with presharded_reloading(self.model):
            self.model.load_weights(iter(weights))
            idle = idle_modules(self.model)
            # Layers loaded only in part (a rank's padded vocabulary rows) are processed
            # here, with the loaders they were given: still ours.
            finalize_layerwise_reload(self.model, self.model_config)
        # A tied head received nothing (its parameter is the embedding's, loaded through
        # the embedding): post-processed again from the new weights, as a fresh start
        # does (see ``presharded.reprocess_shared``).
        redone = reprocess_shared(self.model, idle)
        if redone:
            log.debug("weightd: post-processed again (shared parameters): %s", redone)
