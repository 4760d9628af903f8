"""End to end: quantized checkpoints served out of process, dequantized by the ranks.

For GPTQ (with and without act-order), AWQ and FP8-block checkpoints written in
those formats' conventions (``quantfmt``), each tensor-parallel rank fetches its
tensors from the daemon; dequantizing them must give exactly the rank's slice of
the dequantized whole module.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.conftest import RunningDaemon
from tests.layouts import quantfmt, restate
from tests.layouts.hf import QUANT_CONFIGS
from weightd.client import InvalidArgumentError, WeightClient

pytestmark = pytest.mark.e2e

QuantModels = dict[str, tuple[Path, dict[str, dict[str, torch.Tensor]]]]


@pytest.fixture(scope="module")
def client(layout_daemon: RunningDaemon) -> Iterator[WeightClient]:
    with WeightClient(layout_daemon.target, timeout=120) as c:
        yield c


def dequant(kind: str, m: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind.startswith("gptq"):
        return quantfmt.gptq_dequant(m, 128, desc_act=kind == "gptq-act")
    if kind == "awq":
        return quantfmt.awq_dequant(m, 128)
    return quantfmt.fp8_dequant(m)


@pytest.mark.parametrize("kind", list(QUANT_CONFIGS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ranks_dequantize_to_their_slice_of_the_module(
    client: WeightClient, quant_models: QuantModels, kind: str, tp: int
) -> None:
    _, modules = quant_models[kind]
    config = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64}
    for rank in range(tp):
        state = client.fetch(rank, tp, model=f"quant-{kind}")
        for prefix, module in modules.items():
            mine = {role: state[f"{prefix}.{role}"] for role in module}
            for role, t in mine.items():
                assert t.dtype == module[role].dtype, (prefix, role)
            want = restate.expected(
                prefix + ".weight", dequant(kind, module), config, restate.L(tp, rank)
            )
            assert torch.equal(dequant(kind, mine), want), (kind, tp, rank, prefix)


@pytest.mark.parametrize(
    ("kind", "needles"),
    [
        ("gptq", ("quantization group (group_size 128)", "boundary at 64", "multiples of 128")),
        ("awq", ("quantization group (group_size 128)", "boundary at 64")),
        ("fp8", ("fp8 128x128 scale block", "boundary at 64")),
    ],
)
def test_misaligned_quantization_split_is_invalid_argument(
    client: WeightClient, kind: str, needles: tuple[str, ...]
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        client.fetch(0, 8, model=f"quant-{kind}")
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(r"tensor 'model\.layers\.0\.[a-z_.]+'", err.value.detail), err.value.detail
    for needle in needles:
        assert needle in err.value.detail, (needle, err.value.detail)


def test_act_order_allows_what_plain_groups_refuse(
    client: WeightClient, quant_models: QuantModels
) -> None:
    """desc_act keeps scales/zeros whole on row-parallel ranks, so tp 8 works."""
    _, modules = quant_models["gptq-act"]
    config = {"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64}
    for rank in (0, 5):
        state = client.fetch(rank, 8, model="quant-gptq-act")
        prefix = "model.layers.0.mlp.down_proj"
        mine = {role: state[f"{prefix}.{role}"] for role in modules[prefix]}
        assert mine["scales"].shape == modules[prefix]["scales"].shape
        want = restate.expected(
            prefix + ".weight", dequant("gptq-act", modules[prefix]), config, restate.L(8, rank)
        )
        assert torch.equal(dequant("gptq-act", mine), want)
