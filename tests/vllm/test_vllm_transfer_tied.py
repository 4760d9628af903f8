"""After every in-place update, every parameter equals a fresh engine's: a tied model.

A Qwen3-style model with ``tie_word_embeddings=True`` (vLLM's ``lm_head`` holds the
embedding's parameter), q/k norms and a vocabulary that is not a multiple of vLLM's
padding (1000), at TP=1 and TP=2 (two kv heads: both ranks hold their own). Both
engines start on v1 from disk and go v1 → v2 → v3 → v2 (republished: a new number).

After each step every worker's digests of what it computes with (every named
parameter and buffer, tied names under each module that holds them, and the weights
inside every CPU GEMM, the tied head's included: ``transfer_engine.py``) are compared
with those of a model the same worker builds afresh from that version's directory
through vLLM's own start-up path (``reference``). That shortcut is proven on the spot:
the engines themselves started from v1's directory, so their first state is a real
fresh engine's, and the reference built from v1 must equal it.

Before the fix the tied head kept v1's weights inside its CPU GEMM across every
update (vLLM's layer-wise reload never re-ran its post-processing: nothing is loaded
into it, its parameter is the embedding's), so the engine reported the new version
and generated with v1's head. The untied Llama's same walk is in
``test_vllm_transfer.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_daemon
from tests.models import build_model
from tests.vllm.transfer_fixtures import EngineProcess
from weightd.client import AdminClient

TPS = (1, 2)
Record = dict[str, Any]

TIED = (
    "qwen3",
    dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
)


def same_as(got: list[dict[str, str]], want: list[dict[str, str]]) -> list[str]:
    """Keys whose digests differ (or that one side lacks), on any rank."""
    assert len(got) == len(want)
    return sorted(
        f"rank {r}: {k}"
        for r, (x, y) in enumerate(zip(got, want, strict=True))
        for k in x.keys() | y.keys()
        if x.get(k) != y.get(k)
    )


@pytest.fixture(scope="module")
def tied(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Record]:
    import torch

    root = tmp_path_factory.mktemp("tied-models")
    logs = tmp_path_factory.mktemp("tied-logs")
    kind, overrides = TIED
    dirs = {}
    for name, seed in (("v1", 11), ("v2", 12), ("v3", 13)):
        model = build_model(kind, overrides, seed=seed).to(torch.bfloat16)
        model.save_pretrained(root / name, max_shard_size="400KB")
        dirs[name] = root / name
    rec: Record = {"steps": []}
    with run_daemon(tmp_path_factory.mktemp("tied-daemon"), [("q", dirs["v1"])]) as daemon:
        admin = AdminClient(daemon.address("admin"), timeout=300)
        engines = {
            tp: EngineProcess(
                vllm_python,
                dirs["v1"],
                tp,
                logs / f"tied-tp{tp}.log",
                target=daemon.target,
                model="q",
            )
            for tp in TPS
        }
        try:
            for e in engines.values():
                e.wait_ready()

            def snapshot(directory: Path) -> dict[int, Record]:
                out = {}
                for tp, e in engines.items():
                    state = e.call("state")
                    ref = e.call("reference", dir=str(directory))
                    gen = e.call("generate")
                    assert "state" in state and "state" in ref, f"{state}\n{ref}\n{e.tail()}"
                    out[tp] = {
                        "state": state["state"],
                        "version": state["version"],
                        "reference": ref["state"],
                        "tokens": gen["tokens"],
                    }
                return out

            rec["start"] = snapshot(dirs["v1"])
            for name in ("v2", "v3", "v2"):
                published = admin.publish(str(dirs[name]), model="q")
                for e in engines.values():
                    e.send("update", version=published.version)
                updates = {tp: e.reply() for tp, e in engines.items()}
                rec["steps"].append(
                    {
                        "name": name,
                        "version": published.version,
                        "update": updates,
                        "after": snapshot(dirs[name]),
                    }
                )
        finally:
            for e in engines.values():
                e.close()
            admin.close()
    yield rec


@pytest.mark.parametrize("tp", TPS)
def test_the_reference_is_a_fresh_engine(tied: Record, tp: int) -> None:
    """The engine started from v1's directory: its state is a real fresh engine's."""
    start = tied["start"][tp]
    assert same_as(start["state"], start["reference"]) == []
    for rank in start["state"]:
        # the tied head is there under its own name, with its own GEMM
        assert rank["lm_head.weight"] == rank["model.embed_tokens.weight"]
        assert "gemm:lm_head" in rank
        assert any(k.endswith("q_norm.weight") for k in rank)


@pytest.mark.parametrize("tp", TPS)
def test_every_parameter_equals_a_fresh_engines_after_each_update(tied: Record, tp: int) -> None:
    previous = tied["start"][tp]
    assert [s["name"] for s in tied["steps"]] == ["v2", "v3", "v2"]
    for step in tied["steps"]:
        update, after = step["update"][tp], step["after"][tp]
        assert update.get("ok"), update
        assert after["version"] == str(step["version"])
        assert same_as(after["state"], after["reference"]) == [], step["name"]
        # and it moved: the head's GEMM too
        for rank, digests in enumerate(after["state"]):
            assert digests["gemm:lm_head"] != previous["state"][rank]["gemm:lm_head"]
        assert after["tokens"] != previous["tokens"]
        previous = after
    # v2 again: what the engine held the first time it was on v2
    first, again = tied["steps"][0]["after"][tp], tied["steps"][2]["after"][tp]
    assert same_as(again["state"], first["state"]) == []
    assert again["tokens"] == first["tokens"]
