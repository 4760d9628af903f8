"""Runs the real vLLM engine in ``.venv-vllm`` for tests/vllm; prints one JSON result.

Not a test module (pytest does not collect it): the tests in this folder run in the
project's venv and start this script with ``.venv-vllm/bin/python``, because vLLM
pins its own torch/transformers. One process runs one engine per loader in turn
(``--loaders weightd,auto[,fallback]``; ``fallback``: load_format weightd with the
daemon down and ``"fallback": "disk"``), sharing vLLM's import (~20 s here) between them. For
each engine it records the greedy tokens and their logprobs, every worker's
parameter digests and the weightd loader's report (through vLLM's worker RPC,
``collective_rpc``), and, with ``--checks``, what the loader does in a running worker
for a wrong checkpoint, a daemon that is down and an unknown model.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# collective_rpc with a function (not a method name) needs cloudpickle.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPTS = [[1, 5, 9, 200, 7], [3, 3, 30, 300, 17, 2]]
DOWN = "unix:///nonexistent-weightd/weightd.sock"


def param_digests(worker: Any) -> dict[str, str]:
    import torch

    model = worker.model_runner.model
    return {
        name: hashlib.sha256(
            p.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, p in model.named_parameters()
    }


def load_report(worker: Any) -> dict[str, Any] | None:
    report = getattr(worker.model_runner.model, "weightd_load_report", None)
    if report is None:
        return None
    return {
        "transport": report.transport,
        "bytes": report.bytes,
        "layout": [report.layout.tp_size, report.layout.tp_rank],
        "pp": [report.layout.pp_size, report.layout.pp_rank, list(report.layout.pp_layers)],
        "vocab_pad": report.layout.vocab_pad,
        "shapes": {k: [list(a), list(b)] for k, (a, b) in report.shapes.items()},
        "vocab_blocks": [list(x) for x in report.vocab_blocks],
        "fallback": report.fallback,
        "identity": dict(report.identity),
        "pack_built": report.pack_built,
        "trust_root": report.trust_root,
        "described_over": report.described_over,
        "steps": sorted(report.steps),
    }


def try_load(worker: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """Load the running worker's model again with load_format weightd and ``extra``."""
    from vllm.config import set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    model = worker.model_runner.model
    try:
        loader = get_model_loader(
            LoadConfig(load_format="weightd", model_loader_extra_config=extra)
        )
        # As vLLM's own load_model runs: inside its config context.
        with set_current_vllm_config(worker.vllm_config):
            loader.load_weights(model, worker.model_config)
    except Exception as exc:  # the test asserts on the type and message
        return {"error": f"{type(exc).__name__}: {exc}"}
    report = load_report(worker)
    return {"ok": True, "fallback": report["fallback"] if report else None}


def run_engine(args: argparse.Namespace, load_format: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if load_format == "weightd":
        extra = {"target": args.target, "model": args.model}
    elif load_format == "fallback":  # weightd down, fallback to the disk: a fresh engine
        extra = {"target": DOWN, "timeout": 5, "fallback": "disk"}
    elif load_format == "weightd_old":  # a daemon that predates Layout.vocab_pad
        extra = {"target": args.old_target, "model": args.model}
    llm = LLM(
        model=args.dir,
        load_format="auto" if load_format == "auto" else "weightd",
        model_loader_extra_config=extra,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=128,
        dtype="bfloat16",
        seed=0,
    )
    result: dict[str, Any] = {
        "digests": llm.collective_rpc(param_digests),
        "reports": llm.collective_rpc(load_report),
    }
    if args.generate:
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        result["logprobs"] = [
            [
                step[tok].logprob
                for tok, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)
            ]
            for o in outs
        ]
    if args.checks and load_format == "weightd":
        # Refusals happen before a byte of the model is touched, so a running worker's
        # model can be asked again (a disk fallback cannot: vLLM's CPU post-processing
        # replaced its parameters, so the fallback gets an engine of its own).
        result["checks"] = {
            name: llm.collective_rpc(try_load, args=(extra_cfg,))
            for name, extra_cfg in {
                "other_checkpoint": {"target": args.target, "model": args.other_model},
                # Same config, index and shard sizes; other weights.
                "finetune": {"target": args.target, "model": args.finetune_model},
                "daemon_down": {"target": DOWN, "timeout": 5},
                "not_served": {"target": args.target, "model": "no-such-model"},
            }.items()
        }
        result["digests_after_checks"] = llm.collective_rpc(param_digests)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    # vLLM's CPU build loads a pipeline-parallel model but its PP workers fail the first
    # forward pass whatever the loader (AssertionError in gpu_model_runner.py's
    # sync_and_gather_intermediate_tensors): with --pp, pass --no-generate.
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--no-generate", dest="generate", action="store_false")
    ap.add_argument("--target", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--other-model", default="")
    ap.add_argument("--finetune-model", default="")
    ap.add_argument("--old-target", default="")
    ap.add_argument("--loaders", default="weightd,auto")
    ap.add_argument("--checks", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = {fmt: run_engine(args, fmt) for fmt in args.loaders.split(",")}
    with open(args.out, "w") as f:
        json.dump(results, f)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
