"""End to end: the daemon out of process, checkpoints written by ``transformers``."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import RunningDaemon, run_daemon, weightd_command
from tests.models import (
    CONFIGS,
    build_model,
    expected_slice,
    read_checkpoint,
    split_dim,
    spy_load_state_dict,
)
from weightd.client import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    Transport,
    WeightClient,
)

pytestmark = pytest.mark.e2e

LLAMA_FAMILY = list(CONFIGS)


@pytest.fixture(scope="module")
def daemon(
    transformers_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("daemon")
    # A small chunk size so multi-chunk tensors and shared messages are both exercised.
    with run_daemon(tmp, sorted(transformers_models.items()), ["--chunk-bytes", "8192"]) as d:
        yield d


@pytest.fixture(scope="module")
def client(daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(daemon.target, timeout=60) as c:
        yield c


def _config(directory: Path) -> dict[str, object]:
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("model", LLAMA_FAMILY)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_gets_exactly_its_slice(
    client: WeightClient, transformers_models: dict[str, Path], model: str, world_size: int
) -> None:
    directory = transformers_models[model]
    original = read_checkpoint(directory)
    config = _config(directory)
    ranks = [client.fetch(rank, world_size, model=model) for rank in range(world_size)]
    for rank, state in enumerate(ranks):
        assert set(state) == set(original), f"rank {rank} tensor set differs"
        for name, full in original.items():
            want = expected_slice(name, full, config, world_size, rank)
            got = state[name]
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), (
                f"{model} ws={world_size} rank={rank} {name} differs"
            )
    # Concatenating the ranks along the split dimension reproduces each original; with
    # GQA past the kv-head count, ranks sharing a kv head hold identical copies.
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])  # type: ignore[call-overload]
    for name, full in original.items():
        dim = split_dim(name)
        if dim is None or world_size == 1:
            for state in ranks:
                assert torch.equal(state[name], full)
            continue
        parts = [state[name] for state in ranks]
        if ("k_proj" in name or "v_proj" in name) and world_size > kv:
            group = world_size // kv
            for r in range(world_size):
                assert torch.equal(parts[r], parts[(r // group) * group])
            parts = parts[::group]
        assert torch.equal(torch.cat(parts, dim), full), name


@pytest.mark.parametrize(
    ("transport", "in_place", "copied_by_torch"),
    [("auto", True, "all"), ("grpc", True, "none"), ("grpc", False, "all")],
)
@pytest.mark.parametrize("model", ["llama", "llama-gqa", "qwen3"])
def test_world_size_1_logits_match_from_pretrained(
    client: WeightClient,
    transformers_models: dict[str, Path],
    model: str,
    transport: Transport,
    in_place: bool,
    copied_by_torch: str,
) -> None:
    import transformers

    directory = transformers_models[model]
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    kind, overrides = CONFIGS[model]
    fresh = build_model(kind, overrides, seed=123)  # different weights until loaded
    storage = {n: t.data_ptr() for n, t in fresh.state_dict().items()}
    calls = spy_load_state_dict(fresh)
    info = client.load_into(
        fresh, rank=0, world_size=1, model=model, transport=transport, in_place=in_place
    )
    assert info.transport == ("shm" if transport == "auto" else "grpc")
    # gRPC in place: every slice was received straight into its parameter, so torch
    # copied nothing; otherwise torch copied every fetched tensor in.
    fetched = set(read_checkpoint(directory))
    assert calls == [fetched if copied_by_torch == "all" else set()]
    assert {n: t.data_ptr() for n, t in fresh.state_dict().items()} == storage
    tokens = torch.randint(
        0, int(overrides["vocab_size"]), (2, 12), generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        want = reference(tokens).logits
        got = fresh(tokens).logits
    assert torch.equal(got, want)


def test_load_into_copies_what_does_not_fit_in_place(
    client: WeightClient, transformers_models: dict[str, Path]
) -> None:
    """A float64 module cannot take the checkpoint's bytes as they are: torch casts them."""
    kind, overrides = CONFIGS["llama"]
    fresh = build_model(kind, overrides, seed=7).double()
    calls = spy_load_state_dict(fresh)
    client.load_into(fresh, rank=0, world_size=1, model="llama", transport="grpc")
    want = read_checkpoint(transformers_models["llama"])
    assert calls == [set(want)]  # nothing fitted: every tensor went through torch
    for name, t in fresh.state_dict().items():
        assert t.dtype == torch.float64 and torch.equal(t, want[name].double()), name


def test_weightd_fetch_cli_writes_the_slices(
    daemon: RunningDaemon, client: WeightClient, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "rank1.safetensors"
    done = subprocess.run(
        weightd_command(
            "fetch",
            daemon.target,
            "--model",
            "llama-gqa",
            "--rank",
            "1",
            "--world-size",
            "4",
            "--out",
            str(out),
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    written = load_file(str(out))
    direct = client.fetch(1, 4, model="llama-gqa")
    assert set(written) == set(direct)
    for name, t in direct.items():
        assert torch.equal(written[name], t), name


def test_fetch_names_subset(client: WeightClient, transformers_models: dict[str, Path]) -> None:
    original = read_checkpoint(transformers_models["llama"])
    names = ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
    got = client.fetch(1, 2, model="llama", names=names)
    assert list(got) == names
    assert torch.equal(got[names[0]], original[names[0]].chunk(2, 1)[1])
    assert torch.equal(got[names[1]], original[names[1]])


def test_list_and_describe(client: WeightClient, transformers_models: dict[str, Path]) -> None:
    import blake3

    models = {m.name: m for m in client.list_models()}
    assert set(models) == set(transformers_models)
    assert all(m.ready for m in models.values())
    d = client.describe("llama")
    assert d.architecture == "LlamaForCausalLM"
    original = read_checkpoint(transformers_models["llama"])
    assert {t.name for t in d.tensors} == set(original)
    for t in d.tensors:
        assert list(t.shape) == list(original[t.name].shape)
        raw = original[t.name].contiguous().view(torch.uint8).numpy().tobytes()
        assert t.digest == "blake3:" + blake3.blake3(raw).hexdigest()
        assert (transformers_models["llama"] / t.shard).exists()


# --- error paths, each with its status code and a detail naming the culprit ------------


def test_unknown_model(client: WeightClient) -> None:
    with pytest.raises(NotFoundError) as err:
        client.fetch(0, 1, model="no-such-model")
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in err.value.detail


def test_model_must_be_named_when_several_are_served(client: WeightClient) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        client.fetch(0, 1)
    assert "name one" in err.value.detail


@pytest.mark.parametrize(("rank", "world_size"), [(4, 4), (-1, 2), (0, 0)])
def test_bad_rank(client: WeightClient, rank: int, world_size: int) -> None:
    """Refused with INVALID_ARGUMENT (by the client for values uint32 cannot carry)."""
    with pytest.raises(InvalidArgumentError) as err:
        client.fetch(rank, world_size, model="llama")
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert f"world_size {world_size}" in err.value.detail
    if world_size:
        assert f"rank {rank}" in err.value.detail


def test_bad_rank_reaches_the_daemon(daemon: RunningDaemon) -> None:
    """The daemon itself refuses a rank outside the world (not only the client)."""
    from weightd.v1 import weightd_pb2 as pb
    from weightd.v1 import weightd_pb2_grpc as pb_grpc

    with grpc.insecure_channel(daemon.target) as channel:
        stub = pb_grpc.WeightsStub(channel)
        for layout in (pb.Layout(tp_size=2, tp_rank=2), pb.Layout(tp_size=0, tp_rank=0)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Fetch(pb.FetchRequest(model="llama", layout=layout), timeout=30))
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"world_size {layout.tp_size}" in err.value.details()


def test_non_divisible_dimension(client: WeightClient) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        client.fetch(0, 3, model="llama")
    detail = err.value.detail
    assert "world_size 3" in detail
    # the first tensor in the plan that cannot be split is named, with its size
    assert "tensor 'model." in detail and "not divisible" in detail


def test_gqa_world_size_not_multiple_of_kv_heads(client: WeightClient) -> None:
    # 8 query heads, 2 kv heads: world size 8 works (one kv head per 4 ranks) ...
    assert client.fetch(7, 8, model="llama-gqa", names=["model.layers.0.self_attn.k_proj.weight"])
    # ... world size 6 does not divide the heads at all.
    with pytest.raises(InvalidArgumentError) as err:
        client.fetch(0, 6, model="llama-gqa", names=["model.layers.0.self_attn.k_proj.weight"])
    assert "k_proj" in err.value.detail and "world_size 6" in err.value.detail


def test_unknown_architecture_beyond_world_size_1(client: WeightClient) -> None:
    whole = client.fetch(0, 1, model="unknown-arch")
    assert set(whole) == {"foo.weight", "foo.bias"}
    with pytest.raises(FailedPreconditionError) as err:
        client.fetch(0, 2, model="unknown-arch")
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "FooForCausalLM" in err.value.detail and "world_size 1" in err.value.detail


def test_unknown_tensor_name(client: WeightClient) -> None:
    with pytest.raises(NotFoundError) as err:
        client.fetch(0, 2, model="llama", names=["model.nope.weight"])
    assert "model.nope.weight" in err.value.detail


# --- several streams per fetch (fetch(..., streams=N)) -----------------------------------


@pytest.mark.parametrize("streams", [2, 3, 4])
def test_streams_deliver_exactly_what_one_stream_does(client: WeightClient, streams: int) -> None:
    one = client.fetch(1, 2, model="llama", transport="grpc")
    many = client.fetch(1, 2, model="llama", transport="grpc", streams=streams)
    assert list(many) == list(one)  # same tensors, same order (the description's)
    for name, t in one.items():
        assert many[name].dtype == t.dtype and many[name].shape == t.shape, name
        assert torch.equal(many[name].view(torch.uint8), t.view(torch.uint8)), name
    assert client.last_resume is not None and client.last_resume.streams == streams
    assert client.last_resume.received_bytes == sum(t.nbytes for t in one.values())


def test_streams_with_names_fetch_only_those(client: WeightClient) -> None:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    one = client.fetch(0, 2, model="llama", names=names, transport="grpc")
    many = client.fetch(0, 2, model="llama", names=names, transport="grpc", streams=2)
    assert list(many) == names
    assert all(torch.equal(many[n].view(torch.uint8), one[n].view(torch.uint8)) for n in names)


def test_a_failing_stream_fails_the_whole_fetch(client: WeightClient) -> None:
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.nope.weight"]
    with pytest.raises(NotFoundError) as err:
        client.fetch(0, 2, model="llama", names=names, transport="grpc", streams=3)
    assert "model.nope.weight" in err.value.detail


@pytest.mark.parametrize("streams", [0, 17])
def test_streams_out_of_range_are_refused(client: WeightClient, streams: int) -> None:
    with pytest.raises(InvalidArgumentError, match=f"streams {streams}"):
        client.fetch(0, 2, model="llama", transport="grpc", streams=streams)
