"""A tensor-parallel Llama from a stock Hugging Face model and weightd's per-rank shares.

Run one process per rank with torchrun (CPU and gloo here; NCCL on GPUs works alike):

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        docs/examples/tp_model.py unix:///run/weightd/weightd.sock /path/to/checkpoint

Every rank prints the same greedy continuation: the unsharded model's.

Why not ``model.load_state_dict(share)``: a rank's share has the rank's shapes (at TP=2
half the query and kv heads, half the MLP, half the vocabulary), and the model
``from_pretrained`` builds has the full ones. So build the model with the rank's shapes:
the same ``LlamaForCausalLM`` class, from a config whose head counts, MLP width and
vocabulary are divided by the world size. Its parameters then have exactly the shapes
weightd serves, and the share loads as it is. What the stock model lacks for tensor
parallelism are four collectives, added below as forward hooks: the vocabulary-parallel
embedding (each rank looks up its own rows, then a sum), the row-parallel ``o_proj`` and
``down_proj`` (a sum of the ranks' partial outputs), and the vocabulary-parallel head
(the ranks' logits side by side).

The checkpoint directory is read for ``config.json`` only: the weights come from weightd.
Llama-family models (Llama, Mistral, Qwen2 without q/k/v biases...) with the default
cut (``vocab_pad`` 0: the vocabulary divisible by the world size).
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from weightd.client import WeightClient


def rank_config(config: LlamaConfig, world_size: int) -> LlamaConfig:
    """The config of one rank's share: heads, MLP width and vocabulary divided."""
    for field in ("num_attention_heads", "intermediate_size", "vocab_size"):
        if getattr(config, field) % world_size:
            raise SystemExit(f"{field} {getattr(config, field)} is not divisible by {world_size}")
    local = copy.deepcopy(config)
    local.head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    local.num_attention_heads = config.num_attention_heads // world_size
    # GQA: with more ranks than kv heads, weightd gives each rank the one kv head its
    # query heads use.
    local.num_key_value_heads = max(1, config.num_key_value_heads // world_size)
    local.intermediate_size = config.intermediate_size // world_size
    local.vocab_size = config.vocab_size // world_size
    return local


def add_tensor_parallel_hooks(model: LlamaForCausalLM, rank: int, world_size: int) -> None:
    """The collectives tensor parallelism needs, as forward hooks on the stock modules."""
    embed = model.model.embed_tokens
    rows = embed.num_embeddings  # this rank's block of the vocabulary
    masked: dict[str, torch.Tensor] = {}

    def embed_local_ids(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        local = args[0] - rank * rows
        masked["ids"] = (local < 0) | (local >= rows)
        return (local.masked_fill(masked["ids"], 0), *args[1:])

    def embed_sum(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(masked.pop("ids").unsqueeze(-1), 0.0)
        dist.all_reduce(out)
        return out

    def row_parallel_sum(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out)
        return out

    def gather_vocab(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(parts, out.contiguous())
        return torch.cat(parts, dim=-1)

    embed.register_forward_pre_hook(embed_local_ids)
    embed.register_forward_hook(embed_sum)
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(row_parallel_sum)
        layer.mlp.down_proj.register_forward_hook(row_parallel_sum)
    model.lm_head.register_forward_hook(gather_vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="the daemon's address")
    parser.add_argument("checkpoint", help="the checkpoint directory (config.json is read)")
    parser.add_argument("--model", default=None, help="default: the daemon's only model")
    parser.add_argument("--prompt", default="1,306,2658,278,3186", help="token ids")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--save-logits", default=None, help="rank 0: the prompt's logits")
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")

    config = LlamaConfig.from_pretrained(args.checkpoint)
    local = rank_config(config, world_size)
    # The rank's model, without spending time on a random initialisation: parameters on
    # the meta device, then allocated (uninitialised) on the CPU; only the rotary
    # embedding's computed buffer must be made again.
    with torch.device("meta"):
        model = LlamaForCausalLM(local)
    model.to_empty(device="cpu")
    model.model.rotary_emb = LlamaRotaryEmbedding(config=local)
    model.float().eval()

    with WeightClient(args.target, timeout=120) as client:
        info = client.load_into(model, rank, world_size, model=args.model)
    print(f"rank {rank}: share loaded over {info.transport}", flush=True)

    add_tensor_parallel_hooks(model, rank, world_size)
    ids = torch.tensor([[int(t) for t in args.prompt.split(",")]])
    if int(ids.max()) >= config.vocab_size:
        raise SystemExit(f"token ids must be below the vocabulary size {config.vocab_size}")
    with torch.inference_mode():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    if rank == 0 and args.save_logits:
        torch.save(logits, args.save_logits)
    print(f"rank {rank}: {out[0, ids.shape[1] :].tolist()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
