"""Putting a fetched rank into a ``torch.nn.Module``: in place where it can, strict on names.

Why a module of its own: loading is where the client meets the user's model, and
the rules differ from fetching. A gRPC fetch can receive each slice straight into
the module's own parameter (see ``receive.fits``), which saves a fresh allocation
and a copy per tensor and means the rank is never held twice in memory. What does
not fit (another device, a dtype to cast), and whatever a same-host transport mapped,
is copied in by ``load_state_dict`` as usual. Strictness is judged on names, with tied parameters
(``lm_head.weight`` under ``tie_word_embeddings``) counted as loaded through the
object they share.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def apply_fetched(
    module: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    *,
    strict: bool,
    source: str,
) -> None:
    """Copy what was not received in place; with ``strict``, names must match both ways.

    A tensor received in place is the very ``targets`` object for its name, so it is
    skipped here (copying it onto itself would only cost time).
    """
    in_place = {n for n, t in state.items() if targets.get(n) is t}
    rest = {n: t for n, t in state.items() if n not in in_place}
    result = module.load_state_dict(rest, strict=False)
    if not strict:
        return
    params = dict(module.named_parameters(remove_duplicate=False))
    loaded_ids = {id(params[n]) for n in state if n in params}
    missing = [
        k
        for k in result.missing_keys
        if k not in in_place and (k not in params or id(params[k]) not in loaded_ids)
    ]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"state from {source} does not match {type(module).__name__}: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
