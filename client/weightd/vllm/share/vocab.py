"""vLLM's vocabulary cut, asked of the daemon; reconciled per rank for an old daemon.

vLLM pads the vocabulary to a multiple of its ``padding_size`` (64,
``DEFAULT_VOCAB_PADDING_SIZE``) and gives each rank ``padded / tp`` rows, so rank
``r`` holds checkpoint rows ``[min(r * per, vocab), min((r + 1) * per, vocab))``.
The loader asks the daemon for exactly that cut (``Layout.vocab_pad`` = the model's
``padding_size``, :func:`padded_layout`), so each rank receives its own rows and
nothing more. The daemon confirms the padding in the stream's first message (a pack
grant names it too); the client refuses a stream that does not
(``VocabPadUnsupportedError``).

A daemon that predates ``vocab_pad`` cuts ``tp`` equal blocks of ``vocab / tp``
rows. Against one, the loader fetches with ``vocab_pad`` 0 and :func:`reconcile`
re-cuts: a rank whose rows straddle weightd's blocks fetches the neighbouring blocks
of just that tensor (over gRPC, by name) and keeps the rows vLLM wants. That costs at
most the blocks the rank's rows touch (at TP=2 both blocks: the whole tensor, once,
transiently); it never changes which bytes land in the parameter, and each block is
digest-checked like every other slice. The same path serves a model whose
vocabulary-parallel layers disagree on ``padding_size`` (one ``vocab_pad`` cannot
say both).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightd.client import Layout, VocabPadUnsupportedError

from ..errors import WeightdLoadError

log = logging.getLogger("vllm.weightd")


def _vocab_modules(model: torch.nn.Module) -> list[tuple[str, Any]]:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return [(p, m) for p, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)]


def vllm_vocab_rows(model: torch.nn.Module) -> dict[int, tuple[int, int]]:
    """Checkpoint vocabulary size -> the rows this rank's vocab-parallel layers hold."""
    out: dict[int, tuple[int, int]] = {}
    for prefix, module in _vocab_modules(model):
        si = module.shard_indices
        rows = (si.org_vocab_start_index, si.org_vocab_end_index)
        if out.setdefault(module.org_vocab_size, rows) != rows:
            raise WeightdLoadError(
                f"{prefix}: vocabulary of {module.org_vocab_size} rows is cut at {rows} "
                f"here and at {out[module.org_vocab_size]} in another layer"
            )
    return out


def vocab_padding(model: torch.nn.Module) -> int:
    """The ``padding_size`` every vocab-parallel layer of ``model`` uses; 0 if none or if
    they disagree (then equal blocks and :func:`reconcile` serve each its own rows)."""
    pads = {int(m.padding_size) for _, m in _vocab_modules(model)}
    if len(pads) == 1:
        return pads.pop()
    if pads:
        log.info(
            "weightd: vocabulary-parallel layers pad to %s: fetching equal blocks and "
            "re-cutting each to vLLM's rows",
            sorted(pads),
        )
    return 0


def padded_layout(layout: Layout, model: torch.nn.Module) -> Layout:
    """``layout`` asking for vLLM's vocabulary cut (tp > 1; nothing is cut at tp 1)."""
    if layout.tp_size == 1:
        return layout
    return dataclasses.replace(layout, vocab_pad=vocab_padding(model))


def fetch_rows(
    fetch: Callable[[Layout], dict[str, torch.Tensor]], layout: Layout
) -> tuple[dict[str, torch.Tensor], Layout]:
    """``fetch(layout)``, and the layout the daemon cut by.

    Against a daemon that predates ``vocab_pad`` (it refuses nothing, the client
    refuses its equal blocks), the rank is fetched again with ``vocab_pad`` 0 and the
    vocabulary tensors are re-cut by :func:`vocab_share`.
    """
    if not layout.vocab_pad:
        return fetch(layout), layout
    try:
        return fetch(layout), layout
    except VocabPadUnsupportedError:
        log.info(
            "weightd: the daemon predates vocab_pad; fetching equal vocabulary blocks and "
            "re-cutting them to vLLM's rows"
        )
        plain = dataclasses.replace(layout, vocab_pad=0)
        return fetch(plain), plain


def vocab_share(
    name: str,
    share: torch.Tensor,
    full_shape: tuple[int, ...],
    layout: Layout,
    vocab_rows: Mapping[int, tuple[int, int]],
    fetch_block: Callable[[str, int], torch.Tensor],
) -> torch.Tensor:
    """The rows vLLM wants of a cut tensor ``name``, given what the daemon sent for it.

    With ``layout.vocab_pad`` (the daemon confirmed it) a vocabulary share already is
    vLLM's rows (``presharded`` checks the count); else an equal block of a
    vocabulary tensor is re-cut by :func:`reconcile`. Other tensors pass unchanged.
    """
    if layout.vocab_pad or full_shape[0] not in vocab_rows:
        return share
    if share.shape[0] * layout.tp_size != full_shape[0]:
        return share
    return reconcile(
        name,
        share,
        full_shape[0],
        layout.tp_size,
        layout.tp_rank,
        vocab_rows[full_shape[0]],
        fetch_block,
    )


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
