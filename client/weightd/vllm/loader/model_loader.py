"""``load_format="weightd"``: a vLLM model loader that takes each worker's share from weightd.

In every worker process vLLM builds the model from ``DIR/config.json`` and then calls
:meth:`WeightdModelLoader.load_weights`, which

1. reads the worker's place from vLLM's parallel state (``placement``);
2. asks the daemon to describe its model and refuses to go on unless it is the
   checkpoint in ``DIR`` (``identity``), naming both sides;
3. fetches exactly that layout at the version described (``WeightClient.fetch_layout``:
   shared memory on the daemon's host, gRPC otherwise, every slice checked against the
   daemon's digest);
4. feeds the shares through vLLM's own ``model.load_weights`` (``presharded``), so
   vLLM's fused parameters, tied embeddings, GQA replication and vocabulary padding
   are vLLM's code, and then runs vLLM's own check that every parameter was loaded.

On the daemon's host steps 2 and 3 both go over the side socket (``share/describe.py``):
the load opens no gRPC channel and imports no gRPC module, so what it pays beyond a
plain read of the files is the exchanges on a Unix socket and mapping the pack;
vLLM's own copy into its parameters (step 4) is the floor. Each step's seconds are in
:attr:`LoadReport.steps`.

Failures raise :class:`~weightd.vllm.errors.WeightdLoadError` naming the target,
model and layout. With ``"fallback": "disk"`` such a failure is logged at ERROR and
vLLM's default loader reads ``DIR`` instead; there is no fallback without it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weightd.client import Layout, ModelDescription, WeightClient, WeightdError
from weightd.client.base import errors as e

# The same-host fetch's modules load with the plugin (vLLM imports it as each worker
# starts), as vLLM's default loader loads safetensors with itself: the load then pays
# only the conversation and the copy, not a fresh process's first imports.
from weightd.client.transports import local_fetch as _local_fetch  # noqa: F401

from ..errors import WeightdLoadError
from ..share.describe import describe
from ..share.fetch import LoadReport, Weights, fetch_share
from ..share.identity import compare_files
from ..share.placement import worker_layout
from ..share.presharded import presharded_loading
from ..share.vocab import padded_layout
from .options import LoaderOptions, parse_options

# Under vLLM's logger namespace so its handler and format print these lines with its own.
log = logging.getLogger("vllm.weightd")

#: Attribute the loader sets on the model it loaded: what it received (a LoadReport).
REPORT_ATTR = "weightd_load_report"

__all__ = ["REPORT_ATTR", "LoadReport", "load_from_weightd", "register_loader", "worker_share"]


#: What each situation means for this load, by the client's typed errors (the daemon
#: sends its error class; a daemon that predates that maps by code, to the last rows).
_WHY: tuple[tuple[type[WeightdError], str], ...] = (
    (e.DaemonUnreachable, "no daemon at the target"),
    (e.NotWeightd, "the target is not a weightd daemon"),
    (e.WorkerOnly, "the target is the daemon's admin socket, not its worker socket"),
    (e.MethodNotServed, "the target does not serve weightd's worker calls"),
    (e.ModelNotFound, "model not served"),
    (e.NotServing, "model not serving yet (still verifying) or any more"),
    (e.TensorNotFound, "tensor not in the daemon's model"),
    (e.LayoutRefused, "layout refused"),
    (e.LayoutUnsupported, "layout not supported for this model"),
    (e.ModelBroken, "the daemon's files changed since verification"),
    (e.DigestMismatch, "digest mismatch"),
    (e.InvalidRequest, "request refused"),
    (e.UnavailableError, "daemon unavailable"),
)


def _why(exc: WeightdError) -> str:
    for cls, why in _WHY:
        if isinstance(exc, cls):
            return why
    return exc.reason or type(exc).__name__


def _source(client: WeightClient, desc: ModelDescription) -> str:
    """Where the daemon read ``desc``'s version from ("" when it does not say): the
    first event of a version watch is the model's current version, with its source."""
    try:
        with client.watch_versions(desc.name, timeout=10) as watch:
            for event in watch:
                info = event.info
                if info.version != desc.version:
                    return ""  # published again since the describe: no stale answer
                shown = info.source
                return shown if shown.isprintable() and len(shown) <= 400 else repr(shown[:400])
    except WeightdError:
        pass  # a daemon that predates versions: the message names what it can
    return ""


def _where(options: LoaderOptions, layout: Layout) -> str:
    return f"weightd at {options.target}, model {options.model_label}, layout {layout.describe()}"


def check_identity(
    directory: Path,
    desc: ModelDescription,
    options: LoaderOptions,
    where: str,
    served_from: Callable[[], str] = lambda: "",
) -> dict[str, str]:
    """Refuse a daemon serving another checkpoint; how each shard was proven.

    A refusal names the version the daemon serves and, when ``served_from()`` knows it,
    the directory it was read from: after a ``Publish`` (an RL update) the daemon serves
    a new directory, and an engine started on the original one is refused, rightly; the
    message says where to start it from instead.

    A shard nothing can prove (a daemon that sends no identity for it) is refused too,
    unless the operator opted out (``identity: "warn"``): then a WARNING names it.
    """
    found = compare_files(directory, desc)
    if found.differences:
        source = served_from()
        served = f"version {desc.version}" + (f", read from {source}" if source else "")
        raise WeightdLoadError(
            f"{where}: the daemon's model {desc.name!r} ({served}) is not the checkpoint in "
            f"{directory}: " + "; ".join(str(d) for d in found.differences) + ". Start the "
            "engine from the directory the daemon serves now (after a publish, the latest "
            "published one), or from a directory holding only its config.json and "
            "tokenizer (the weights then come from weightd alone)"
        )
    proven = dict(found.proven)
    if found.unchecked:
        what = ", ".join(f"{n} ({why})" for n, why in sorted(found.unchecked.items()))
        if options.identity != "warn":
            raise WeightdLoadError(
                f"{where}: cannot prove that the daemon's model {desc.name!r} is the "
                f"checkpoint in {directory}: not checked: {what}. Upgrade the daemon, or "
                "pass model_loader_extra_config identity='warn' to load anyway"
            )
        log.warning(
            "weightd IDENTITY NOT CHECKED (identity='warn'): loading the daemon's model %r "
            "for %s without proof that these shards are its files: %s",
            desc.name,
            directory,
            what,
        )
        proven.update({n: f"UNCHECKED: {why}" for n, why in found.unchecked.items()})
    return proven


def worker_share(
    directory: Path, layout: Layout, model: torch.nn.Module, options: LoaderOptions
) -> tuple[Weights, LoadReport]:
    """Steps 2-3 above, the worker's whole conversation with the daemon: the model
    described, ``directory`` proven to be it, the rank's share of that version fetched.

    Needs no vLLM (``model`` is read only for its vocabulary cut above TP=1), so a test
    runs it in a fresh process and sees that no gRPC module was imported on the
    daemon's host. Raises WeightdLoadError.
    """
    where = _where(options, layout)
    steps: dict[str, float] = {}
    clock = time.perf_counter()

    def step(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        steps[name] = now - clock
        clock = now

    try:
        with WeightClient(options.target, timeout=options.timeout) as client:
            desc, described_over = describe(client, options.model, transport=options.transport)
            step("describe")
            served_from = lambda: _source(client, desc)  # noqa: E731 -- only on a refusal
            identity = check_identity(directory, desc, options, where, served_from)
            step("identity")
            # The version described, not whatever is current when the fetch arrives: a
            # publish in between must not load other weights than the ones proven.
            weights, report = fetch_share(
                client, desc, layout, model, transport=options.transport, version=desc.version
            )
            step("fetch")
    except WeightdError as exc:
        raise WeightdLoadError(f"{where}: {_why(exc)}: {exc}") from exc
    report.target = options.target
    report.identity = identity
    report.trust_root = desc.trust_root
    report.described_over = described_over
    report.steps = steps
    return weights, report


def load_from_weightd(
    model: torch.nn.Module, model_config: Any, options: LoaderOptions
) -> LoadReport:
    """Steps 1-4 above; returns what was received. Raises WeightdLoadError."""
    started = time.perf_counter()
    layout = padded_layout(worker_layout(model_config), model)
    placed = time.perf_counter()
    weights, report = worker_share(Path(model_config.model), layout, model, options)
    copied = time.perf_counter()
    with presharded_loading(model):
        loaded = model.load_weights(iter(weights))  # type: ignore[operator]
    del weights
    loaded_at = time.perf_counter()
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if model_config.quantization is None and loaded is not None:
        DefaultModelLoader(_disk_config(None)).track_weights_loading(model, loaded)
    ended = time.perf_counter()
    report.steps = {
        "placement": placed - started,
        **report.steps,
        "load_weights": loaded_at - copied,
        "check_loaded": ended - loaded_at,
    }
    report.seconds = ended - started
    return report


def _disk_config(load_config: Any) -> Any:
    """vLLM's default loader's config: this one with the default format, no extra config."""
    from vllm.config.load import LoadConfig

    base = load_config if load_config is not None else LoadConfig()
    return dataclasses.replace(base, load_format="auto", model_loader_extra_config={})


_registered = False


def register_loader() -> None:
    """Register the loader once per process (vLLM may call its plugins more than once)."""
    global _registered  # noqa: PLW0603 -- registration is per process by vLLM's design
    if _registered:
        return
    _registered = True
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    @register_model_loader("weightd")
    class WeightdModelLoader(BaseModelLoader):  # type: ignore[misc]
        """vLLM's weights from a weightd daemon; see the module's docstring."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = parse_options(load_config.model_loader_extra_config)

        def download_model(self, model_config: Any) -> None:
            """Nothing to download: the weights come from the daemon, the config from DIR."""

        def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
            try:
                report = load_from_weightd(model, model_config, self.options)
            except WeightdLoadError as exc:
                if self.options.fallback != "disk":
                    raise
                log.error(
                    "weightd FALLBACK: %s -- loading %s from disk with vLLM's default "
                    "loader instead (model_loader_extra_config fallback='disk')",
                    exc,
                    model_config.model,
                )
                DefaultModelLoader(_disk_config(self.load_config)).load_weights(model, model_config)
                report = LoadReport(
                    self.options.target, self.options.model or "", worker_layout(model_config)
                )
                report.fallback = str(exc)
                setattr(model, REPORT_ATTR, report)
                return
            setattr(model, REPORT_ATTR, report)
            # Worded as vLLM's default loader words its line, so one pattern reads both.
            log.info(
                "weightd: Loading weights took %.2f seconds (%d tensors, %.1f MiB, %s, over %s; "
                "proven by %s)",
                report.seconds,
                len(report.shapes),
                report.bytes / 2**20,
                report.layout.describe(),
                report.transport,
                report.trust_root or "the digests computed at load",
            )
