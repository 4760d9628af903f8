"""vLLM's vocabulary cut versus weightd's, reconciled per rank.

weightd cuts a vocabulary-parallel tensor in ``tp`` equal blocks of
``vocab / tp`` rows. vLLM first pads the vocabulary to a multiple of 64
(``DEFAULT_VOCAB_PADDING_SIZE``) and gives each rank ``padded / tp`` rows, so rank
``r`` holds checkpoint rows ``[min(r * per, vocab), min((r + 1) * per, vocab))``.
The two agree whenever the vocabulary is a multiple of 64 (Llama 2/3, Qwen2, ...).
When it is not, a rank's rows straddle weightd's blocks: the loader then fetches
the neighbouring blocks of just that tensor (over gRPC, by name) and keeps the rows
vLLM wants. That costs at most the blocks the rank's rows touch (at TP=2 both
blocks: the whole tensor, once, transiently); it never changes which bytes land in
the parameter, and each block is digest-checked like every other slice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from .errors import WeightdLoadError


def vllm_vocab_rows(model: torch.nn.Module) -> dict[int, tuple[int, int]]:
    """Checkpoint vocabulary size -> the rows this rank's vocab-parallel layers hold."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    out: dict[int, tuple[int, int]] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, VocabParallelEmbedding):
            continue
        si = module.shard_indices
        rows = (si.org_vocab_start_index, si.org_vocab_end_index)
        if out.setdefault(module.org_vocab_size, rows) != rows:
            raise WeightdLoadError(
                f"{prefix}: vocabulary of {module.org_vocab_size} rows is cut at {rows} "
                f"here and at {out[module.org_vocab_size]} in another layer"
            )
    return out


def reconcile(
    name: str,
    share: torch.Tensor,
    full_rows: int,
    tp_size: int,
    tp_rank: int,
    wanted: tuple[int, int],
    fetch_block: Callable[[str, int], torch.Tensor],
) -> torch.Tensor:
    """The rows ``wanted`` of ``name``, given weightd's block ``tp_rank`` (``share``)."""
    per = full_rows // tp_size
    start, stop = wanted
    if (start, stop) == (tp_rank * per, (tp_rank + 1) * per):
        return share
    if stop <= start:
        return share[:0]
    first, last = start // per, (stop - 1) // per
    blocks: Mapping[int, torch.Tensor] = {
        j: share if j == tp_rank else fetch_block(name, j) for j in range(first, last + 1)
    }
    joined = blocks[first] if first == last else torch.cat([blocks[j] for j in sorted(blocks)])
    return joined[start - first * per : stop - first * per]
