"""What the update backend refuses before any rank fetches, with vLLM's own classes.

Run under ``.venv-vllm`` in one short process (no engine): ``shared_problems`` on
modules sharing a parameter, with vLLM's real post-processing methods (the
unquantized embedding method, which re-runs exactly, and one that does not), and on a
model-level post-load hook; ``content_digest`` of descriptions that differ only where
two daemons serving the same bytes may differ, and of ones that differ in content. The
engine tests (``test_vllm_transfer*.py``) show both with running engines.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

SCRIPT = r"""
import dataclasses, json, sys
import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from weightd.client import ModelDescription, TensorInfo
from weightd.vllm.share.presharded import shared_problems
from weightd.vllm.transfer.engine import content_digest


class Packing(QuantizeMethodBase):  # post-processing that is not known to repeat
    def create_weights(self, *args, **kwargs): pass
    def apply(self, *args, **kwargs): pass
    def process_weights_after_loading(self, layer): pass


def model(head_method, hook=False):
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.embed_tokens = torch.nn.Module()
    root.model.embed_tokens.weight = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)
    root.model.embed_tokens.quant_method = UnquantizedEmbeddingMethod()
    root.lm_head = torch.nn.Module()
    root.lm_head.weight = root.model.embed_tokens.weight  # tied
    root.lm_head.quant_method = head_method
    if hook:
        root.process_weights_after_loading = lambda: None
    return root


def desc(shard, digest="aa", name="m", order=1):
    tensors = [
        TensorInfo("a", "BF16", (2, 2), shard, 8, digest),
        TensorInfo("b", "BF16", (2,), shard, 4, "bb"),
    ]
    return ModelDescription(name, "Llama", "{}", 12, tuple(tensors[::order]), version=7)


x = content_digest(desc("x.safetensors"))
json.dump({
    "tied_unquantized": shared_problems(model(UnquantizedEmbeddingMethod())),
    "tied_packing": shared_problems(model(Packing())),
    "hook": shared_problems(model(UnquantizedEmbeddingMethod(), hook=True)),
    "same": x == content_digest(desc("y.safetensors", name="n", order=-1)),
    "other": x == content_digest(desc("x.safetensors", digest="ab")),
}, sys.stdout)
"""


@pytest.fixture(scope="module")
def result(vllm_python: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [str(vllm_python), "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_a_tied_head_whose_post_processing_repeats_is_accepted(result: dict[str, Any]) -> None:
    assert result["tied_unquantized"] == []


def test_a_tied_parameter_post_processed_otherwise_is_refused_naming_both(
    result: dict[str, Any],
) -> None:
    (problem,) = result["tied_packing"]
    assert "model.embed_tokens.weight = lm_head.weight are one parameter" in problem
    assert "lm_head's post-processing (Packing) cannot be re-run in place" in problem


def test_a_model_level_post_load_hook_is_refused(result: dict[str, Any]) -> None:
    (problem,) = result["hook"]
    assert "post-processes its weights as a whole after loading" in problem


def test_the_content_digest_is_the_bytes_not_the_daemon(result: dict[str, Any]) -> None:
    assert result["same"] is True  # other shard files, model name, tensor order
    assert result["other"] is False  # one tensor's verified digest differs
