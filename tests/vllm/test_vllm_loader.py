"""``load_format="weightd"`` in the real vLLM engine against vLLM's default loader.

For a Llama (GQA, vocabulary not a multiple of vLLM's padding) and a Qwen2 (q/k/v
biases, tied embeddings, one kv head: replicated at TP=2) checkpoint, at TP=1 and
TP=2: the same greedy tokens and logprobs, every worker's parameters bit-identical,
each worker received only its share; a wrong checkpoint, a daemon that is down and an
unknown model are refused naming target, model and layout; ``fallback: disk`` loads
from disk and says so. The Llama's vocabulary (1000 rows) is cut as vLLM cuts it by the
daemon itself (``Layout.vocab_pad`` 64): no rank fetches a neighbour's block; against a
daemon that predates the field, the loader re-cuts equal blocks and loads the same
parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import RunningDaemon
from tests.old_daemon import FieldForgettingProxy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

CASES = [("llama", 1), ("llama", 2), ("qwen2", 1), ("qwen2", 2)]
Engine = Callable[[str, int], dict[str, Any]]
DOWN = "unix:///nonexistent-weightd/weightd.sock"


@pytest.mark.parametrize(("model", "tp"), CASES)
def test_tokens_logprobs_and_parameters_equal_the_default_loaders(
    engine: Engine, model: str, tp: int
) -> None:
    result = engine(model, tp)
    ours, theirs = result["weightd"], result["auto"]
    assert ours["tokens"] == theirs["tokens"]
    assert ours["logprobs"] == theirs["logprobs"]
    assert len(ours["digests"]) == tp
    for rank, (a, b) in enumerate(zip(ours["digests"], theirs["digests"], strict=True)):
        assert a == b, f"rank {rank}: {sorted(k for k in a if a[k] != b.get(k))}"
    assert theirs["reports"] == [None] * tp  # the default engine never used weightd


def _share(name: str, full: list[int], model: str, tp: int, rank: int) -> list[int]:
    """The shape a worker must receive, from the table in docs/guides/layouts.md."""
    if tp == 1 or (len(full) == 1 and not name.endswith("_proj.bias")):
        return full  # norms; q/k/v biases are cut like their weights' rows
    if "o_proj" in name or "down_proj" in name:
        return [full[0], full[1] // tp]
    if model == "qwen2" and ("k_proj" in name or "v_proj" in name):
        return full  # one kv head: each rank gets that head (replication)
    if full[0] == 1000:  # llama's vocabulary tensors
        # vLLM pads 1000 rows to 1024: rank 0 holds rows [0, 512), rank 1 [512, 1000)
        return [512 if rank == 0 else 488, full[1]]
    return [full[0] // tp, *full[1:]]


@pytest.mark.parametrize(("model", "tp"), CASES)
def test_each_worker_received_only_its_share(engine: Engine, model: str, tp: int) -> None:
    reports = engine(model, tp)["weightd"]["reports"]
    for rank, report in enumerate(reports):
        assert report["layout"] == [tp, rank]
        # vLLM's padding_size, sent at tp > 1 (at tp 1 nothing is cut)
        assert report["vocab_pad"] == (64 if tp > 1 else 0)
        assert report["transport"] == "shm"  # the daemon's host: its shared packs
        assert report["described_over"] == "shm"  # and its describe: no gRPC channel
        assert report["steps"] == sorted(
            ["placement", "describe", "identity", "fetch", "load_weights", "check_loaded"]
        )
        for name, (got, full) in report["shapes"].items():
            assert got == _share(name, full, model, tp, rank), name
        # The daemon cut vLLM's rows itself: nobody fetched a neighbour's block.
        assert report["vocab_blocks"] == []
    if model == "qwen2":
        assert "lm_head.weight" not in reports[0]["shapes"]  # tied: never invented


def test_an_old_daemons_equal_blocks_are_re_cut_to_the_same_parameters(
    engine: Engine, old_daemon: FieldForgettingProxy
) -> None:
    """A daemon that ignores vocab_pad: the client refuses its stream, the loader fetches
    equal blocks and re-cuts (rank 0's rows straddle [0, 500) | [500, 1000), so it fetches
    block 1 of both vocabulary tensors), and the parameters are the default loader's."""
    result = engine("llama", 2)
    old, theirs = result["weightd_old"], result["auto"]
    assert old["tokens"] == theirs["tokens"]
    assert old["logprobs"] == theirs["logprobs"]
    assert old["digests"] == theirs["digests"]
    reports = old["reports"]
    assert [r["transport"] for r in reports] == ["grpc", "grpc"]  # no side socket there
    assert [r["described_over"] for r in reports] == ["grpc", "grpc"]
    assert [r["vocab_pad"] for r in reports] == [0, 0]  # what it fell back to
    assert sorted(map(tuple, reports[0]["vocab_blocks"])) == [
        ("lm_head.weight", 1),
        ("model.embed_tokens.weight", 1),
    ]
    assert reports[1]["vocab_blocks"] == []
    for rank, report in enumerate(reports):
        for name, (got, full) in report["shapes"].items():
            assert got == _share(name, full, "llama", 2, rank), name
    asked = [r.layout.vocab_pad for r in old_daemon.requests]
    assert 64 in asked and 0 in asked  # asked, refused, asked again


def test_a_wrong_checkpoint_a_daemon_down_and_an_unknown_model_are_refused(
    engine: Engine, daemon: RunningDaemon
) -> None:
    checks = engine("llama", 1)["weightd"]["checks"]
    [other] = checks["other_checkpoint"]
    assert other["error"].startswith(
        f"WeightdLoadError: weightd at {daemon.target}, model 'qwen2', layout tp 0/1: the "
        "daemon's model 'qwen2' (version 1, read from "
    )
    assert ") is not the checkpoint in " in other["error"]
    assert "Start the engine from the directory the daemon serves now" in other["error"]
    assert "config.json: sha256 " in other["error"]
    assert " in the model directory, sha256 " in other["error"]
    # A fine-tune of the same base: config, index and shard sizes equal, weights not.
    [finetune] = checks["finetune"]
    assert finetune["error"].startswith(
        f"WeightdLoadError: weightd at {daemon.target}, model 'llama_ft', layout tp 0/1: the "
        "daemon's model 'llama_ft' (version 1, read from "
    )
    assert "config.json: " not in finetune["error"]  # the same config and index
    assert ".safetensors: sampled tensor bytes hash to edges4k-sha256:" in finetune["error"]
    [down] = checks["daemon_down"]
    assert down["error"].startswith(
        f"WeightdLoadError: weightd at {DOWN}, model (the "
        "daemon's only model), layout tp 0/1: no daemon at the target: "
    )
    [missing] = checks["not_served"]
    assert missing["error"].startswith(
        f"WeightdLoadError: weightd at {daemon.target}, model 'no-such-model', layout tp 0/1: "
        "model not served: "
    )


def test_fallback_disk_loads_with_vllms_loader_and_says_so(engine: Engine) -> None:
    result = engine("llama", 1)
    fallback = result["fallback"]
    [report] = fallback["reports"]
    assert report["fallback"].startswith(
        f"weightd at {DOWN}, model (the daemon's only model), layout tp 0/1: no daemon at the"
    )
    assert f"weightd FALLBACK: weightd at {DOWN}" in result["log"]
    assert "loading " in result["log"] and "from disk with vLLM's default loader" in result["log"]
    assert fallback["digests"] == result["auto"]["digests"]
    assert fallback["tokens"] == result["auto"]["tokens"]


def test_refused_checks_left_the_running_model_untouched(engine: Engine) -> None:
    ours = engine("llama", 1)["weightd"]
    assert ours["digests_after_checks"] == ours["digests"]


@pytest.mark.parametrize(("model", "tp"), CASES)
def test_the_first_load_of_a_declared_layout_maps_the_pack_built_at_start(
    engine: Engine, daemon: RunningDaemon, model: str, tp: int
) -> None:
    """The session daemon declares every layout these engines ask for: each engine's
    first weightd load maps a pack the daemon built before it reported SERVING (its
    request built nothing), and every shard of DIR was proven to be the daemon's file
    (the same file on this host) before a byte was loaded."""
    reports = engine(model, tp)["weightd"]["reports"]
    log = daemon.log()
    for rank, report in enumerate(reports):
        assert report["transport"] == "shm"
        assert report["pack_built"] is False
        label = f"tp{tp}:r{rank}" + (":v64" if tp > 1 else "")
        built = f"pack_built model={model} layout={label} "
        assert built in log and log.index(built) < log.index("weightd: serving models=")
        assert report["identity"] and set(report["identity"].values()) == {"same file"}
