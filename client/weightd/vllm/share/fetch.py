"""One worker's share of a served model, fetched and ready for vLLM's ``load_weights``.

What the loader (``load_format="weightd"``) and the weight-transfer backend (a new
version, in place) both do once they know the worker's layout and the daemon's
description of the model: fetch exactly that layout (shared memory on the daemon's
host, gRPC otherwise; every slice checked against the daemon's digest), reconcile the
vocabulary cut against a daemon that predates ``vocab_pad`` (``vocab.py``), and mark
every tensor that is a share rather than a whole tensor, so that ``presharded.py``
lets vLLM's own weight loaders place it without cutting it again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from weightd.client import Layout, ModelDescription, Transport, WeightClient

from .presharded import mark
from .vocab import fetch_rows, vllm_vocab_rows, vocab_share

Weights = list[tuple[str, torch.Tensor]]


@dataclass
class LoadReport:
    """What one worker received: for tests, benchmarks and the log."""

    target: str
    model: str
    layout: Layout
    transport: str = ""
    seconds: float = 0.0
    bytes: int = 0
    #: name -> (shape received, shape in the checkpoint)
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    #: extra (tensor, weightd block) fetched to reconcile vLLM's vocabulary cut (only
    #: against a daemon that predates ``vocab_pad``: see ``vocab.py``)
    vocab_blocks: list[tuple[str, int]] = field(default_factory=list)
    fallback: str = ""  # the error a fallback load replaced, if any
    #: shard -> how it was proven to be the daemon's ("same file", "cache blob",
    #: "sampled"), or "UNCHECKED: why" (only with the operator's ``identity: warn``)
    identity: dict[str, str] = field(default_factory=dict)
    #: This worker's request built its pack (shared memory only; False: prebuilt)
    pack_built: bool = False
    #: The trust root that proved the served version (``ModelDescription.trust_root``:
    #: "oms-key:...", "oms-certificate:...", "manifest:...", ...; "" none but the
    #: digests computed at load)
    trust_root: str = ""
    #: The wire the model was described over: "shm" (the side socket) or "grpc"
    described_over: str = ""
    #: Seconds per step of the load, in order ("placement", "describe", "identity",
    #: "fetch", "load_weights": vLLM's copy into its parameters, "check_loaded")
    steps: dict[str, float] = field(default_factory=dict)


def fetch_share(
    client: WeightClient,
    desc: ModelDescription,
    layout: Layout,
    model: torch.nn.Module,
    *,
    transport: Transport = "auto",
    version: int = 0,
    verify: bool = False,
) -> tuple[Weights, LoadReport]:
    """The worker's share of ``desc`` (at ``version``; 0: the current one) as
    ``(name, tensor)`` pairs for ``model.load_weights``, and what was received.

    Raises the client's :class:`~weightd.client.WeightdError` subclasses; nothing is
    returned unless every slice arrived and passed its digest (a shared-memory pack is
    re-hashed here only with ``verify``; the daemon verified it as it built it).
    """
    state, layout = fetch_rows(
        lambda lay: client.fetch_layout(
            lay, model=desc.name, transport=transport, version=version, verify=verify
        ),
        layout,
    )
    info = client.last_fetch
    report = LoadReport(client.target, desc.name, layout)
    report.transport = info.transport if info is not None else ""
    # Whether this worker's request built the pack (False: built before it asked, e.g.
    # at the daemon's load for a declared layout).
    report.pack_built = bool(info and info.pack and info.pack.built)
    full = {t.name: t.shape for t in desc.tensors}
    vocab_rows = vllm_vocab_rows(model) if layout.tp_size > 1 else {}

    def block(name: str, j: int) -> torch.Tensor:
        report.vocab_blocks.append((name, j))
        other = dataclasses.replace(layout, tp_rank=j)
        got = client.fetch_layout(
            other, model=desc.name, names=[name], transport="grpc", version=version
        )
        return got[name]

    weights: Weights = []
    for name, tensor in state.items():
        shape = full[name]
        t = tensor
        if tuple(t.shape) != shape:
            t = mark(vocab_share(name, t, shape, layout, vocab_rows, block))
        report.shapes[name] = (tuple(t.shape), shape)
        report.bytes += t.numel() * t.element_size()
        weights.append((name, t))
    return weights, report
