"""End to end: every built-in architecture, written by ``transformers``, served out of process.

For each tiny random model and each valid tensor-parallel size in {1, 2, 4} (and a
few pipeline / expert-parallel layouts), every worker fetches its tensors from the
daemon; each must be exactly the restated rule's slice, and the workers' slices
must reassemble every original tensor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import RunningDaemon
from tests.layouts import restate
from tests.layouts.hf import ARCHS
from tests.models import read_checkpoint
from weightd.client import Layout, WeightClient

pytestmark = pytest.mark.e2e

MOE = {"mixtral", "qwen2-moe", "qwen3-moe"}
CASES = [
    *[(name, (tp, 1, 1)) for name in ARCHS for tp in (1, 2, 4)],
    *[(name, (2, 2, 1)) for name in ("llama", "llama-tied", "gemma", "phi3")],
    *[(name, layout) for name in sorted(MOE) for layout in ((1, 1, 2), (2, 1, 2), (1, 2, 4))],
]


@pytest.fixture(scope="module")
def client(layout_daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(layout_daemon.target, timeout=120) as c:
        yield c


def _config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())


def _kv_group(config: dict[str, Any], tp: int) -> int:
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return tp // kv if tp > kv else 1


def reassemble(
    name: str, pieces: list[torch.Tensor], config: dict[str, Any], tp: int
) -> torch.Tensor:
    """Undo the tensor-parallel cut: ``pieces`` are ranks 0..tp-1's slices, in order."""
    heads = int(config["num_attention_heads"])
    hd = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    group = _kv_group(config, tp)
    if re.search(r"\.(k_proj|v_proj)\.(weight|bias)$", name):
        for r in range(tp):  # ranks sharing a kv head hold the same copy
            assert torch.equal(pieces[r], pieces[(r // group) * group])
        return torch.cat(pieces[::group], 0)
    if name.endswith("qkv_proj.weight"):
        q_local, kv_local = heads * hd // tp, max(1, kv // tp) * hd
        parts = [p.split([q_local, kv_local, kv_local], 0) for p in pieces]
        ks = [p[1] for p in parts][::group]
        vs = [p[2] for p in parts][::group]
        return torch.cat(
            [torch.cat([p[0] for p in parts], 0), torch.cat(ks, 0), torch.cat(vs, 0)], 0
        )
    if name.endswith("gate_up_proj.weight"):
        halves = [p.chunk(2, 0) for p in pieces]
        return torch.cat(
            [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)], 0
        )
    if re.search(r"\.(o_proj|down_proj|w2)\.weight$", name):
        return torch.cat(pieces, 1)
    if re.search(
        r"\.(q_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)$|(embed_tokens|lm_head)\.", name
    ):
        return torch.cat(pieces, 0)
    for p in pieces:  # replicated: every rank holds the whole tensor
        assert torch.equal(p, pieces[0])
    return pieces[0]


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_every_worker_gets_exactly_its_slices_and_they_reassemble(
    client: WeightClient, arch_models: dict[str, Path], model: str, layout: tuple[int, int, int]
) -> None:
    directory = arch_models[model]
    original = read_checkpoint(directory)
    config = _config(directory)
    tp, pp, ep = layout
    got: dict[restate.L, dict[str, torch.Tensor]] = {}
    for lay in restate.every(tp, pp, ep):
        if (pp, ep) == (1, 1):
            got[lay] = client.fetch(lay.tp_rank, tp, model=model)
        else:
            wire = Layout(tp, lay.tp_rank, pp, lay.pp_rank, ep, lay.ep_rank)
            got[lay] = client.fetch_layout(wire, model=model)
    for lay, state in got.items():
        want = {n for n in original if restate.holds(n, config, lay, original)}
        assert set(state) == want, f"{model} {lay}: tensor set differs"
        for name, t in state.items():
            expected = restate.expected(name, original[name], config, lay)
            assert t.dtype == expected.dtype and t.shape == expected.shape, (name, lay)
            assert torch.equal(t.view(torch.uint8), expected.contiguous().view(torch.uint8)), (
                f"{model} {lay} {name} differs"
            )
    # Reassemble: for each tensor, one tensor-parallel group that holds it.
    for name, full in original.items():
        holders = [lay for lay in got if name in got[lay]]
        assert holders, f"{name} is held by no worker"
        first = holders[0]
        group = [
            lay for lay in holders if (lay.pp_rank, lay.ep_rank) == (first.pp_rank, first.ep_rank)
        ]
        pieces = [got[lay][name] for lay in sorted(group, key=lambda x: x.tp_rank)]
        if tp == 1 or len(pieces) == 1:
            assert torch.equal(pieces[0], full), name
        else:
            assert torch.equal(reassemble(name, pieces, config, tp), full), name


@pytest.mark.parametrize("layout", [(2, 1, 2), (4, 1, 4), (1, 3, 2)])
def test_stacked_experts_are_cut_along_experts_and_inside(
    client: WeightClient, stacked_model: Path, layout: tuple[int, int, int]
) -> None:
    """Experts stacked on dim 0 (transformers 5's layout): each rank's experts block, cut
    for tensor parallelism inside; anchored digests cover both dims (client-checked)."""
    original = read_checkpoint(stacked_model)
    config = _config(stacked_model)
    tp, pp, ep = layout
    for lay in restate.every(tp, pp, ep):
        wire = Layout(tp, lay.tp_rank, pp, lay.pp_rank, ep, lay.ep_rank)
        state = client.fetch_layout(wire, model="stacked-experts")
        assert set(state) == {n for n in original if restate.holds(n, config, lay, original)}
        for name, t in state.items():
            want = restate.expected(name, original[name], config, lay).contiguous()
            # random bytes: compare bits (NaN != NaN)
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), (name, lay)
