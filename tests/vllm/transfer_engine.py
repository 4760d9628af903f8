"""One real vLLM engine, driven command by command, for tests/vllm/test_vllm_transfer*.py.

Not a test module. It runs under ``.venv-vllm/bin/python`` (vLLM pins its own torch),
starts one ``LLM`` with ``weight_transfer_config={"backend": "weightd"}`` and then
answers commands, one JSON object per line on stdin, with one JSON object per line on
the file descriptor ``--reply-fd`` (vLLM's workers write their logs to stdout):

* ``{"op": "state"}``: every worker's digest of every parameter and buffer, and of
  the weights each CPU linear layer really computes with (read back through its
  packed GEMM: ``cpu_linear(I) = W^T``, exact, since the CPU build replaced the
  parameter by an empty one when it repacked it), plus the engine's weight version;
* ``{"op": "reference", "dir": D}``: the same digests of a model each worker builds
  afresh from directory ``D`` through vLLM's start-up path (what a fresh engine on
  ``D`` holds; the tests prove it against real fresh engines);
* ``{"op": "generate"}``: greedy tokens and their logprobs for fixed prompts;
* ``{"op": "update", "version": N, ...}``: :func:`weightd.vllm.transfer.rl.update_llm`
  (the other keys are its arguments, ``target`` and ``model`` the engine's unless
  given); the
  reply has ``error`` when vLLM raised, and every worker's update report;
* ``{"op": "quit"}``.

One process per engine configuration drives every step of a test (an engine start
costs 40-90 s here); the test process starts it and sends the steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import traceback
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# collective_rpc with a function (not a method name) needs cloudpickle.
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPTS = [[1, 5, 9, 200, 7], [3, 3, 30, 300, 17, 2], [11, 12, 13]]


def _digest(t: Any) -> str:
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def model_state(model: Any) -> dict[str, str]:
    """Digests of what ``model`` computes with (see the module docstring).

    Every name of every parameter and buffer, tied ones under each module that holds
    them (``remove_duplicate=False``: a tied ``lm_head.weight`` is listed beside
    ``embed_tokens.weight``), and the weights inside every CPU GEMM, whether the layer
    kept its parameter (embeddings, heads) or the repacking replaced it by an empty one.
    """
    import torch

    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.numel():
            out[name] = _digest(p)
    for name, b in model.named_buffers(remove_duplicate=False):
        if b.numel():
            out["buffer:" + name] = _digest(b)
    with torch.no_grad():
        for prefix, module in model.named_modules(remove_duplicate=False):
            linear = getattr(module, "cpu_linear", None)
            weight = getattr(module, "weight", None)
            if linear is None or weight is None:
                continue
            k = int(weight.shape[1]) if weight.numel() else int(module.input_size_per_partition)
            eye = torch.eye(k, dtype=weight.dtype)
            out["gemm:" + prefix] = _digest(linear(eye, weight, None))
    return out


def worker_state(worker: Any) -> dict[str, str]:
    """:func:`model_state` of this worker's running model."""
    return model_state(worker.model_runner.model)


def reference_state(worker: Any, directory: str) -> dict[str, str]:
    """:func:`model_state` of a model this worker builds afresh from ``directory``.

    vLLM's own start-up path (``DefaultModelLoader.load_model``: create the model, load
    the checkpoint, ``process_weights_after_loading``), in this worker, with its
    parallel state, so the result is what a fresh engine's same rank holds. The
    engine's config points at ``directory`` only for the call; the new model's
    attention layers register in a context of their own, not the engine's.
    """
    import gc

    from vllm.config import set_current_vllm_config
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    config = worker.vllm_config
    model_config = config.model_config
    compilation = config.compilation_config
    saved = (model_config.model, model_config.revision, compilation.static_forward_context)
    weights = getattr(model_config, "model_weights", None)
    try:
        model_config.model, model_config.revision = directory, None
        if weights is not None:
            model_config.model_weights = ""
        compilation.static_forward_context = {}
        with set_current_vllm_config(config):
            model = get_model_loader(LoadConfig(load_format="auto")).load_model(
                vllm_config=config, model_config=model_config
            )
        state = model_state(model)
    finally:
        model_config.model, model_config.revision, compilation.static_forward_context = saved
        if weights is not None:
            model_config.model_weights = weights
    del model
    gc.collect()
    return state


def worker_report(worker: Any) -> dict[str, Any] | None:
    engine = worker.weight_transfer_engine
    last = getattr(engine, "last", None)
    if last is None:
        return None
    share = last.share
    return {
        "rank": last.rank,
        "ok": last.ok,
        "error": last.error,
        "version": engine.version,
        "hold_seconds": last.hold_seconds,
        "stage_seconds": last.stage_seconds,
        "apply_seconds": last.apply_seconds,
        "transport": share.transport if share else "",
        "bytes": share.bytes if share else 0,
        "layout": [share.layout.tp_size, share.layout.tp_rank] if share else [],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--reply-fd", type=int, required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--max-model-len", type=int, default=128)
    args = ap.parse_args()
    reply = os.fdopen(args.reply_fd, "w", buffering=1)

    def send(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")

    from vllm import LLM, SamplingParams

    from weightd.vllm.transfer.rl import update_llm

    extra: dict[str, Any] = {}
    if args.load_format == "weightd":
        extra = {"target": args.target, "model": args.model}
    llm = LLM(
        model=args.dir,
        load_format=args.load_format,
        model_loader_extra_config=extra,
        tensor_parallel_size=args.tp,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        dtype="bfloat16",
        seed=0,
        weight_transfer_config={"backend": "weightd"},
    )
    if args.target:  # as a trainer would: the backend's init makes each rank's layout known
        llm.init_weight_transfer_engine({"init_info": {"target": args.target, "model": args.model}})
    send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            if op == "quit":
                send({"ok": True})
                break
            if op == "state":
                send(
                    {"state": llm.collective_rpc(worker_state), "version": llm.get_weight_version()}
                )
            elif op == "reference":
                send({"state": llm.collective_rpc(reference_state, args=(command["dir"],))})
            elif op == "generate":
                params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False
                )
                send(
                    {
                        "tokens": [list(o.outputs[0].token_ids) for o in outs],
                        "logprobs": [
                            [
                                step[tok].logprob
                                for tok, step in zip(
                                    o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True
                                )
                            ]
                            for o in outs
                        ],
                    }
                )
            elif op == "update":
                version = command.pop("version")
                try:
                    kwargs = {"target": args.target, "model": args.model, **command}
                    got = update_llm(llm, version, **kwargs)
                except Exception as exc:  # the test asserts on the message
                    send(
                        {
                            "error": f"{type(exc).__name__}: {exc}",
                            "reports": llm.collective_rpc(worker_report),
                            "version": llm.get_weight_version(),
                        }
                    )
                else:
                    send({"ok": True, "version": got, "reports": llm.collective_rpc(worker_report)})
            else:
                send({"error": f"unknown op {op!r}"})
        except Exception:
            send({"error": traceback.format_exc()})
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
