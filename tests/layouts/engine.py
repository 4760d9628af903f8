"""A minimal tensor/pipeline/expert-parallel engine: one process per rank, gloo, fp32.

Run as ``python -m tests.layouts.engine SPEC.json`` by ``test_forward``. Every rank
fetches its own weights from the daemon (``WeightClient.fetch_layout``) and runs the
Megatron-style parallel forward written here in plain torch — no ``transformers``
in the rank processes — for each scenario of the spec, in order:

* ``layer``: a Llama or Phi-3 decoder layer at tensor parallel ``tp``: local heads
  (GQA: the rank's kv head when tp > num_kv_heads), all-reduce after ``o_proj`` and
  after ``down_proj``; Phi-3's fused ``qkv_proj``/``gate_up_proj`` split locally.
* ``moe``: a Mixtral sparse-MoE block at expert parallel ``ep`` x tensor parallel
  ``tp``: the replicated router picks top-k experts; each rank runs its own experts'
  column/row slices; one all-reduce sums every rank's contribution.
* ``pp``: a whole causal LM in ``pp`` stages x ``tp``: vocab-parallel embedding,
  the stage's layers, activations sent to the next stage, final norm and the
  (tied) vocab-parallel head on the last stage, logits all-gathered.

The parent computes the unsharded ``transformers`` reference and compares.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as nnf

from weightd.client import Layout, WeightClient


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def attention(
    x: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o_w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    group: Any,
) -> torch.Tensor:
    b, s, _ = x.shape
    q = q.view(b, s, -1, head_dim).transpose(1, 2)
    k = k.view(b, s, -1, head_dim).transpose(1, 2)
    v = v.view(b, s, -1, head_dim).transpose(1, 2)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    rep = q.shape[1] // k.shape[1]  # local query heads per local kv head
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = nnf.scaled_dot_product_attention(q, k, v, is_causal=True, scale=head_dim**-0.5)
    out = out.transpose(1, 2).reshape(b, s, -1) @ o_w.T
    dist.all_reduce(out, group=group)
    return out


def decoder_layer(
    h: torch.Tensor, w: dict[str, torch.Tensor], p: str, c: dict[str, Any], group: Any, tp: int
) -> torch.Tensor:
    eps, hd = float(c["rms_norm_eps"]), int(c["head_dim"])
    x = rms(h, w[p + "input_layernorm.weight"], eps)
    if p + "self_attn.qkv_proj.weight" in w:  # Phi-3: this rank's [q | k | v] heads
        q_rows = int(c["num_attention_heads"]) * hd // tp
        kv_rows = max(1, int(c["num_key_value_heads"]) // tp) * hd
        q, k, v = (x @ w[p + "self_attn.qkv_proj.weight"].T).split([q_rows, kv_rows, kv_rows], -1)
    else:
        q, k, v = (x @ w[f"{p}self_attn.{n}_proj.weight"].T for n in "qkv")
    cos, sin = w["cos"], w["sin"]
    h = h + attention(x, q, k, v, w[p + "self_attn.o_proj.weight"], cos, sin, hd, group)
    y = rms(h, w[p + "post_attention_layernorm.weight"], eps)
    if p + "mlp.gate_up_proj.weight" in w:  # Phi-3: this rank's [gate | up] halves
        gate, up = (y @ w[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
    else:
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
    m = (nnf.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    dist.all_reduce(m, group=group)
    return h + m


def moe_block(
    h: torch.Tensor, w: dict[str, torch.Tensor], p: str, c: dict[str, Any], top_k: int
) -> torch.Tensor:
    x = h.reshape(-1, h.shape[-1])
    probs = torch.softmax((x @ w[p + "gate.weight"].T).float(), -1)
    top, index = torch.topk(probs, top_k, -1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    owned = sorted({int(m.group(1)) for n in w if (m := re.search(r"experts\.(\d+)\.w1\.", n))})
    for e in owned:
        token, slot = torch.where(index == e)
        if token.numel() == 0:
            continue
        xe = x[token]
        ye = nnf.silu(xe @ w[f"{p}experts.{e}.w1.weight"].T) * (
            xe @ w[f"{p}experts.{e}.w3.weight"].T
        )
        out.index_add_(0, token, (ye @ w[f"{p}experts.{e}.w2.weight"].T) * top[token, slot, None])
    dist.all_reduce(out)  # every (ep, tp) rank's partial sums
    return out.reshape(h.shape)


def layers_of(w: dict[str, torch.Tensor]) -> list[int]:
    return sorted({int(m.group(1)) for n in w if (m := re.search(r"\.layers\.(\d+)\.", n))})


def pipeline(
    ids: torch.Tensor,
    w: dict[str, torch.Tensor],
    c: dict[str, Any],
    lay: Layout,
    group: Any,
    hidden: int,
) -> torch.Tensor | None:
    """This stage's part of the forward; the last stage returns the full logits."""
    tp, rank = lay.tp_size, lay.tp_rank
    world_rank = dist.get_rank()
    if lay.pp_rank == 0:
        table = w["model.embed_tokens.weight"]
        lo = rank * table.shape[0]
        local = (ids >= lo) & (ids < lo + table.shape[0])
        h = nnf.embedding((ids - lo).clamp(0, table.shape[0] - 1), table) * local.unsqueeze(-1)
        dist.all_reduce(h, group=group)
    else:
        h = torch.empty(*ids.shape, hidden)
        dist.recv(h, src=world_rank - tp)
    for i in layers_of(w):
        h = decoder_layer(h, w, f"model.layers.{i}.", c, group, tp)
    if lay.pp_rank < lay.pp_size - 1:
        dist.send(h, dst=world_rank + tp)
        return None
    h = rms(h, w["model.norm.weight"], float(c["rms_norm_eps"]))
    head = w.get("lm_head.weight", w.get("model.embed_tokens.weight"))
    assert head is not None
    local_logits = h @ head.T
    parts = [torch.empty_like(local_logits) for _ in range(tp)]
    dist.all_gather(parts, local_logits, group=group)
    return torch.cat(parts, -1)


def main(spec_path: str) -> None:
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    with open(spec_path) as f:
        spec = json.load(f)
    world, rank = int(spec["world_size"]), int(spec["rank"])
    dist.init_process_group("gloo", init_method=spec["init"], world_size=world, rank=rank)
    inputs = load_file(spec["inputs"])
    outputs: dict[str, torch.Tensor] = {}
    report: dict[str, Any] = {}
    client = WeightClient(spec["target"], timeout=120)
    for sc in spec["scenarios"]:
        tp, pp, ep = int(sc.get("tp", 1)), int(sc.get("pp", 1)), int(sc.get("ep", 1))
        assert tp * pp * ep == world
        lay = Layout(tp, rank % tp, pp, rank // (tp * ep), ep, (rank // tp) % ep)
        # Every rank creates every tensor-parallel group, in the same order.
        groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
        group = groups[rank // tp]
        w = client.fetch_layout(lay, model=sc["model"])
        w = {n: t.float() for n, t in w.items()}
        report[sc["name"]] = {
            "tensors": sorted(w),
            "layout": [lay.tp_rank, lay.pp_rank, lay.ep_rank],
        }
        c = sc["config"]
        key = sc["name"]
        if sc["kind"] == "layer":
            w["cos"], w["sin"] = inputs[f"{key}.cos"], inputs[f"{key}.sin"]
            out = decoder_layer(inputs[f"{key}.h"], w, f"model.layers.{sc['layer']}.", c, group, tp)
            if rank == 0:
                outputs[key] = out
        elif sc["kind"] == "moe":
            p = f"model.layers.{sc['layer']}.block_sparse_moe."
            out = moe_block(inputs[f"{key}.h"], w, p, c, int(c["num_experts_per_tok"]))
            if rank == 0:
                outputs[key] = out
        else:
            w["cos"], w["sin"] = inputs[f"{key}.cos"], inputs[f"{key}.sin"]
            logits = pipeline(inputs[f"{key}.ids"].long(), w, c, lay, group, int(c["hidden_size"]))
            if logits is not None and lay.tp_rank == 0:
                outputs[key] = logits
        dist.barrier()
    client.close()
    save_file(
        {k: v.contiguous() for k, v in outputs.items()}, f"{spec['out']}.rank{rank}.safetensors"
    )
    with open(f"{spec['out']}.rank{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
