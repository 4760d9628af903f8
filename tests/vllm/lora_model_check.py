"""Run under ``.venv-vllm``: vLLM's ``LoRAModel`` built through weightd's shared hand-over
equals the one vLLM builds from the adapter's directory (no engine started).

``python lora_model_check.py <shared lora_path> <adapter dir>`` with ``WEIGHTD_LORA`` set;
prints one JSON line: what was compared and what differed.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper

from weightd.vllm.lora.options import ENV, parse_lora_options
from weightd.vllm.lora.worker import install

#: What vLLM's Llama accepts (its packed modules' parts).
EXPECTED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def build(path: str) -> LoRAModel:
    helper = PEFTHelper.from_local_dir(path, 256)
    return LoRAModel.from_local_checkpoint(
        path, EXPECTED, peft_helper=helper, lora_model_id=1, device="cpu", dtype=torch.float32
    )


def main() -> None:
    shared, directory = sys.argv[1], sys.argv[2]
    install(parse_lora_options(os.environ[ENV]))
    install(parse_lora_options(os.environ[ENV]))  # idempotent: wrapped once
    got, ref = build(shared), build(directory)
    differ = []
    for name, r in ref.loras.items():
        g = got.loras.get(name)
        same = g is not None and (g.rank, g.scaling) == (r.rank, r.scaling)
        if not (same and torch.equal(g.lora_a, r.lora_a) and torch.equal(g.lora_b, r.lora_b)):
            differ.append(name)
    views = sum(  # tensors still viewing the daemon's pack (zero copy until vLLM's own)
        1 for lw in got.loras.values() if not lw.lora_a.untyped_storage().resizable()
    )
    out = {
        "modules": len(ref.loras),
        "extra": sorted(set(got.loras) - set(ref.loras)),
        "differ": differ,
        "views": views,
        "ranks": sorted({lw.rank for lw in got.loras.values()}),
    }
    del got
    gc.collect()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
