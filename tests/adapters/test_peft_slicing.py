"""Real PEFT adapters: loaded, verified, sliced per rank, and reassembled/applied per rank.

The expected per-rank slices come from ``tests.models.expected_slice`` (the TP rules
restated with torch indexing), not from weightd's planner; the arithmetic check runs
each rank's base slice plus its LoRA slices and compares with PEFT's own layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.adapters.conftest import Fixture
from tests.models import expected_slice, read_checkpoint
from weightd.server.adapters.load import LoadedAdapter, load_adapter
from weightd.server.adapters.plan import plan_adapter
from weightd.server.checkpoint.description import Checkpoint
from weightd.server.checkpoint.scan import load_checkpoint
from weightd.server.plan.builtin_rules import rules_for
from weightd.server.plan.rules import ArchRules

PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def base(lora: Fixture) -> Iterator[tuple[Checkpoint, ArchRules | None]]:
    ckpt, store = load_checkpoint(str(lora.base_dir), "tiny-llama")
    store.close()
    yield ckpt, rules_for(ckpt.config)


def rank_tensors(
    adapter: LoadedAdapter, base: tuple[Checkpoint, ArchRules | None], ws: int, rank: int
) -> dict[str, torch.Tensor]:
    ckpt, rules = base
    plan = plan_adapter(adapter.modules, ckpt, rules, ws, rank)
    out = {}
    for s in plan.slices:
        raw = bytearray(adapter.read(s.pattern))
        assert len(raw) == s.nbytes
        out[s.name] = torch.frombuffer(raw, dtype=torch.float32).reshape(s.shape)
    return out


def test_loads_and_maps_every_peft_module(lora: Fixture, base: Any) -> None:
    adapter = load_adapter(str(lora.adapter_dir), [str(lora.root)], base[0])
    saved = load_file(str(lora.adapter_dir / "adapter_model.safetensors"))
    assert len(adapter.modules) == 2 * 7
    assert {f"{PREFIX}{m.module}.lora_A.weight" for m in adapter.modules} | {
        f"{PREFIX}{m.module}.lora_B.weight" for m in adapter.modules
    } == set(saved)
    down = next(m for m in adapter.modules if m.module.endswith("down_proj"))
    q = next(m for m in adapter.modules if m.module.endswith("q_proj"))
    assert (down.r, down.scaling, q.r, q.scaling) == (2, 4.0, 4, 2.0)  # rank_pattern, alpha/r
    assert set(adapter.tensor_digests) == set(saved)
    assert adapter.digest.startswith("sha256:")
    # Same bytes, same digest: loading twice is deterministic.
    again = load_adapter(str(lora.adapter_dir), [str(lora.root)], base[0], adapter.digest)
    assert again.digest == adapter.digest


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_rank_slices_follow_the_base_cut(lora: Fixture, base: Any, ws: int) -> None:
    adapter = load_adapter(str(lora.adapter_dir), [str(lora.root)], base[0])
    saved = load_file(str(lora.adapter_dir / "adapter_model.safetensors"))
    config = dict(base[0].config)
    for rank in range(ws):
        got = rank_tensors(adapter, base, ws, rank)
        assert len(got) == len(saved)
        for m in adapter.modules:
            a = saved[f"{PREFIX}{m.module}.lora_A.weight"]
            b = saved[f"{PREFIX}{m.module}.lora_B.weight"]
            row_parallel = m.module.endswith(("o_proj", "down_proj"))
            if row_parallel:  # A [r, in] cut like the base's input dim; B whole
                want_a = expected_slice(m.base_tensor, a, config, ws, rank)
                want_b = b
            else:  # B [out, r] cut like the base's output dim (GQA kv included); A whole
                want_a = a
                want_b = expected_slice(m.base_tensor, b, config, ws, rank)
            assert torch.equal(got[f"{m.module}.lora_A.weight"], want_a), m.module
            assert torch.equal(got[f"{m.module}.lora_B.weight"], want_b), m.module


def test_tp1_reassembles_peft_tensors_exactly(lora: Fixture, base: Any) -> None:
    adapter = load_adapter(str(lora.adapter_dir), [str(lora.root)], base[0])
    saved = load_file(str(lora.adapter_dir / "adapter_model.safetensors"))
    got = rank_tensors(adapter, base, 1, 0)
    assert {PREFIX + k: v for k, v in got.items()}.keys() == saved.keys()
    for k, v in got.items():
        assert torch.equal(v, saved[PREFIX + k])


def test_tp2_layers_match_peft(lora: Fixture, base: Any) -> None:
    """Each LoRA layer, run as two tensor-parallel ranks from weightd's slices, equals
    PEFT's layer output (fp32, <= 1e-5): column-parallel outputs concatenate, row-parallel
    partial outputs sum (the all-reduce)."""
    adapter = load_adapter(str(lora.adapter_dir), [str(lora.root)], base[0])
    weights = read_checkpoint(lora.base_dir)
    config = dict(base[0].config)
    ws = 2
    per_rank = [rank_tensors(adapter, base, ws, r) for r in range(ws)]
    layers = dict(lora.peft_model.base_model.model.named_modules())
    torch.manual_seed(0)
    for m in adapter.modules:
        w = weights[m.base_tensor]
        x = torch.randn(3, w.shape[1])
        with torch.no_grad():
            want = layers[m.module](x)
        parts = []
        for rank in range(ws):
            a = per_rank[rank][f"{m.module}.lora_A.weight"]
            b = per_rank[rank][f"{m.module}.lora_B.weight"]
            w_r = expected_slice(m.base_tensor, w, config, ws, rank)
            x_r = x.chunk(ws, 1)[rank] if m.module.endswith(("o_proj", "down_proj")) else x
            parts.append(x_r @ w_r.T + m.scaling * (x_r @ a.T) @ b.T)
        if m.module.endswith(("o_proj", "down_proj")):
            got = parts[0] + parts[1]
        else:
            got = torch.cat(parts, dim=1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # The adapter really changes the layer (non-zero lora_B).
        assert not torch.allclose(x @ w.T, want, atol=1e-4)
