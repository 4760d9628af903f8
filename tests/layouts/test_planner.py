"""The planner, table-driven, against the rules restated with torch (``restate``).

Every built-in architecture variant (``specs.VARIANTS``) is planned for every worker
of many (tp, pp, ep) layouts; each worker's tensor set, slice shapes and gathered
bytes must be exactly what the restated rules give. A meta-test checks that these
tables exercise every rule of every built-in table.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from tests.layouts import restate
from tests.layouts.fakes import as_bytes, fake_checkpoint
from tests.layouts.specs import VARIANTS
from weightd.server.plan.builtin_rules import BUILTIN_TABLES, rules_for
from weightd.server.plan.layout import Layout, every_rank, stage_ranges
from weightd.server.plan.planner import plan
from weightd.server.plan.slices import peer_slices

DENSE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (8, 1, 1), (1, 2, 1), (2, 3, 1), (4, 2, 1)]
MOE_LAYOUTS = [*DENSE_LAYOUTS, (1, 1, 2), (2, 1, 2), (1, 1, 4), (2, 2, 2), (4, 1, 4), (8, 3, 2)]
MOE = {"mixtral", "qwen2-moe", "qwen3-moe", "deepseek-names", "stacked-experts"}

CASES = [
    pytest.param(variant, layout, id=f"{variant}-tp{layout[0]}-pp{layout[1]}-ep{layout[2]}")
    for variant in VARIANTS
    for layout in (MOE_LAYOUTS if variant in MOE else DENSE_LAYOUTS)
]


@pytest.mark.parametrize(("variant", "layout"), CASES)
def test_every_worker_gets_exactly_its_slices(variant: str, layout: tuple[int, int, int]) -> None:
    config, specs = VARIANTS[variant]
    fake = fake_checkpoint(config, specs)
    rules = rules_for(config)
    tp, pp, ep = layout
    held_anywhere: set[str] = set()
    for lay in restate.every(tp, pp, ep):
        got = plan(
            fake.ckpt, rules, Layout(lay.tp, lay.tp_rank, lay.pp, lay.pp_rank, lay.ep, lay.ep_rank)
        )
        want = [n for n in specs if restate.holds(n, config, lay, specs)]
        assert [s.name for s in got.slices] == [n for n in fake.ckpt.tensors if n in want], lay
        for s in got.slices:
            expected = restate.expected(s.name, fake.tensors[s.name], config, lay)
            assert s.shape == tuple(expected.shape), (s.name, lay)
            assert fake.gather(s.shard, s.pattern) == as_bytes(expected), (s.name, lay)
            assert s.replicated == (s.shape == s.full_shape and s.partition.count == 1)
        held_anywhere.update(s.name for s in got.slices)
    assert held_anywhere == set(specs), "some tensor is held by no worker"


def test_every_builtin_rule_is_exercised() -> None:
    """Tables share rules (the Llama attention rules are Mixtral's too): each distinct
    rule must be the first match of some tensor of these variants, in some table."""
    used = set()
    for config, specs in VARIANTS.values():
        rules = rules_for(config)
        assert rules is not None
        for name in specs:
            hit = rules.rule_for(name)
            assert hit is not None, name
            used.add(hit[0])
    missing = [(t.family, r.pattern) for t in BUILTIN_TABLES for r in t.rules if r not in used]
    assert not missing


PEER_CASES = [
    *[(v, lay) for v in ("llama", "phi3", "gemma") for lay in ((2, 1, 1), (4, 2, 1), (8, 3, 1))],
    *[
        (v, lay)
        for v in ("mixtral", "stacked-experts")
        for lay in ((2, 1, 1), (4, 2, 2), (8, 1, 4), (1, 1, 4))
    ],
]


@pytest.mark.parametrize(("variant", "layout"), PEER_CASES)
def test_peer_slices_are_the_peers_plans(variant: str, layout: tuple[int, int, int]) -> None:
    """The anchor's enumeration agrees with what each peer worker is actually planned."""
    config, specs = VARIANTS[variant]
    rules = rules_for(config)
    tp, pp, ep = layout
    fake = fake_checkpoint(config, specs)
    plans = {lay: plan(fake.ckpt, rules, lay) for lay in every_rank(tp, pp, ep)}
    for lay, p in plans.items():
        for s in p.slices:
            peers = peer_slices(fake.ckpt, rules, s, lay)
            assert len(peers) == s.partition.count
            assert peers[s.partition.index].pattern == s.pattern
            for other, q in plans.items():
                mine = {x.name: x for x in q.slices}
                if s.name in mine and mine[s.name].partition.key == s.partition.key:
                    index = mine[s.name].partition.index
                    assert peers[index].pattern == mine[s.name].pattern, (s.name, other)


def test_partition_keys_name_the_cut_not_the_stage() -> None:
    config, specs = VARIANTS["stacked-experts"]
    fake = fake_checkpoint(config, specs)
    rules = rules_for(config)
    name = "model.layers.0.mlp.experts.down_proj"
    a = plan(fake.ckpt, rules, Layout(2, 1, 1, 0, 2, 1), (name,)).slices[0]
    assert a.partition.key == (2, 2) and a.partition.index == 3 and a.partition.count == 4
    q = "model.layers.0.self_attn.q_proj.weight"
    b = plan(fake.ckpt, rules, Layout(2, 1, 1, 0, 2, 1), (q,)).slices[0]
    c = plan(fake.ckpt, rules, Layout(2, 1, 3, 0, 2, 0), (q,)).slices[0]
    assert b.partition == c.partition and b.pattern == c.pattern
    norm = "model.norm.weight"
    d = plan(fake.ckpt, rules, Layout(2, 1, 1, 0, 2, 1), (norm,)).slices[0]
    assert d.partition.count == 1 and d.replicated


# --- pipeline stages ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "pp", "explicit", "want"),
    [
        (20, 4, (), [(0, 5), (5, 10), (10, 15), (15, 20)]),
        (22, 4, (), [(0, 5), (5, 11), (11, 17), (17, 22)]),
        (5, 3, (), [(0, 2), (2, 4), (4, 5)]),
        (61, 2, (), [(0, 31), (31, 61)]),
        (61, 4, (), [(0, 15), (15, 30), (30, 46), (46, 61)]),
        (3, 1, (), [(0, 3)]),
        (20, 4, (4, 6, 6, 4), [(0, 4), (4, 10), (10, 16), (16, 20)]),
        (4, 3, (0, 3, 1), [(0, 0), (0, 3), (3, 4)]),
    ],
)
def test_stage_ranges(
    layers: int, pp: int, explicit: tuple[int, ...], want: list[tuple[int, int]]
) -> None:
    """vLLM's default split (its own test's goldens), and explicit per-stage counts."""
    assert stage_ranges(layers, pp, explicit) == want


def test_tied_embedding_goes_to_first_and_last_stage() -> None:
    for variant, tied in (("llama-tied", True), ("llama", False), ("gemma", True)):
        config, specs = VARIANTS[variant]
        fake = fake_checkpoint(config, specs)
        rules = rules_for(config)
        for stage in range(3):
            p = plan(fake.ckpt, rules, Layout(pp_size=3, pp_rank=stage))
            names = {s.name for s in p.slices}
            has_embed = "model.embed_tokens.weight" in names
            assert has_embed == (stage == 0 or (tied and stage == 2)), (variant, stage)
            assert ("model.norm.weight" in names) == (stage == 2)
            assert ("lm_head.weight" in names) == (stage == 2 and not tied)


def test_explicit_stage_layers() -> None:
    config, specs = VARIANTS["llama"]
    fake = fake_checkpoint(config, specs)
    rules = rules_for(config)
    got = []
    for lay in every_rank(1, 2, 1, (1, 2)):
        slices = plan(fake.ckpt, rules, lay).slices
        got.append(sorted({s.name.split(".")[2] for s in slices if ".layers." in s.name}))
    assert got == [["0"], ["1", "2"]]


# --- expert parallelism ----------------------------------------------------------------


def test_experts_in_contiguous_blocks_and_router_everywhere() -> None:
    config, specs = VARIANTS["qwen2-moe"]  # 8 experts, layer 0 dense
    fake = fake_checkpoint(config, specs)
    rules = rules_for(config)
    for ep_rank in range(4):
        names = [s.name for s in plan(fake.ckpt, rules, Layout(ep_size=4, ep_rank=ep_rank)).slices]
        experts = {int(n.split(".")[5]) for n in names if ".experts." in n}
        assert experts == {2 * ep_rank, 2 * ep_rank + 1}
        assert "model.layers.1.mlp.gate.weight" in names
        assert "model.layers.1.mlp.shared_expert.down_proj.weight" in names
        assert "model.layers.0.mlp.down_proj.weight" in names


# --- hashing what the planner cut: real files -------------------------------------------


def test_anchor_digests_every_peer_of_a_stacked_expert_cut(tmp_path: Any) -> None:
    """integrity.anchor_slices hashes the peers of a 2-D cut (ep x tp) from one read."""
    import json

    from safetensors.torch import save_file

    from weightd.server.checkpoint.scan import load_checkpoint
    from weightd.server.trust.integrity import anchor_slices, hash_checkpoint

    config, specs = VARIANTS["stacked-experts"]
    fake = fake_checkpoint(config, specs, shards=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in fake.tensors.items()}, str(path))
    ckpt, store = load_checkpoint(str(tmp_path))
    try:
        digests = hash_checkpoint(ckpt, store)
        rules = rules_for(config)
        raw = path.read_bytes()
        p = "model.layers.1."
        for name in (
            p + "mlp.experts.gate_up_proj",
            p + "mlp.experts.down_proj",
            p + "self_attn.o_proj.weight",
            p + "self_attn.k_proj.weight",
        ):
            for layout in (Layout(2, 0, 1, 0, 2, 1), Layout(4, 3, 1, 0, 4, 2), Layout(8, 5)):
                s = plan(ckpt, rules, layout, (name,)).slices[0]
                peers = peer_slices(ckpt, rules, s, layout)
                patterns = [x.pattern for x in peers]
                got = anchor_slices(store, ckpt.tensors[name], digests[name], patterns)
                want = [
                    "sha256:"
                    + hashlib.sha256(b"".join(raw[o : o + n] for o, n in q.ranges())).hexdigest()
                    for q in patterns
                ]
                assert got == want, (name, layout)
    finally:
        store.close()


def test_plan_of_trivial_layout_needs_no_rules() -> None:
    config = {"architectures": ["FooForCausalLM"]}
    fake = fake_checkpoint(config, {"a": ("F32", (4, 4))})
    p = plan(fake.ckpt, rules_for(config), Layout())
    assert [s.name for s in p.slices] == ["a"] and p.slices[0].replicated
    assert torch.equal(torch.tensor(p.nbytes), torch.tensor(64))
