"""Checking a parsed adapter against the base model it is loaded on. Pure.

PEFT saves each LoRA pair of module ``M`` as ``base_model.model.M.lora_A.weight``
(``[r, in]``) and ``base_model.model.M.lora_B.weight`` (``[out, r]``); ``M.weight`` of
the base is ``[out, in]``. Everything a worker will multiply is checked here, before
the adapter is published: every tensor is one half of a pair, every pair's module is
targeted by the config and is a 2-D weight of the served base, and the shapes agree
with both the base layer and the module's ``r`` (``rank_pattern`` included).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ..base.errors import (
    AdapterBaseMismatch,
    AdapterConfigError,
    AdapterDtypeError,
    AdapterShapeError,
    AdapterTargetError,
    AdapterTensorError,
)
from ..checkpoint.description import Checkpoint, TensorInfo
from ..checkpoint.header import Header
from .config import AdapterConfig

#: Dtypes an adapter may hold: what PEFT trains and saves in practice.
ALLOWED_DTYPES: Final = frozenset({"F32", "F16", "BF16"})
#: Bound on modules x rank/alpha pattern keys: each key is a regex tried on each module.
MAX_PATTERN_MATCHES: Final = 1 << 21
_NAME: Final = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<half>lora_A|lora_B)\.weight$")


@dataclass(frozen=True, slots=True)
class AdapterModule:
    """One LoRA pair, tied to the base tensor it modifies."""

    module: str  # e.g. "model.layers.0.self_attn.q_proj"
    base_tensor: str  # e.g. "model.layers.0.self_attn.q_proj.weight"
    r: int
    scaling: float
    a: TensorInfo  # [r, in], served as "<module>.lora_A.weight"
    b: TensorInfo  # [out, r], served as "<module>.lora_B.weight"


def base_matches(declared: str, ckpt: Checkpoint) -> bool:
    """Whether ``base_model_name_or_path`` plausibly names ``ckpt``.

    PEFT writes whatever the base was loaded from: a hub id (``org/name``) or a local
    directory. Either matches when it names the served model's directory or its name.
    The string comes from the adapter's file: one with a NUL byte names nothing (and
    ``realpath`` would raise on it).
    """
    if "\x00" in declared:
        return False
    if os.path.isabs(declared):
        return os.path.realpath(declared) == os.path.realpath(ckpt.root)
    tail = declared.rstrip("/").rsplit("/", 1)[-1]
    names = {ckpt.name, os.path.basename(os.path.realpath(ckpt.root))}
    return declared in names or tail in names


def verify_adapter(
    path: str, header: Header, config: AdapterConfig, base: Checkpoint
) -> tuple[AdapterModule, ...]:
    """Every LoRA pair of the adapter file at ``path``, checked against ``base``.

    ``header`` is the strictly parsed header of ``adapter_model.safetensors``; the
    modules come back in the base checkpoint's tensor order, so a plan is stable.
    """
    declared = config.base_model_name_or_path
    if declared is not None and not base_matches(declared, base):
        raise AdapterBaseMismatch(
            path,
            f"adapter_config.json names base model {declared!r}, but it is being loaded on "
            f"model {base.name!r} ({base.root})",
        )
    shard = os.path.basename(path)
    halves: dict[str, dict[str, TensorInfo]] = {}
    for e in header.entries:
        m = _NAME.match(e.name)
        if m is None:
            raise AdapterTensorError(
                path,
                f"tensor {e.name!r} is not a LoRA weight "
                "('base_model.model.<module>.lora_A.weight' or '...lora_B.weight')",
            )
        if e.dtype not in ALLOWED_DTYPES:
            raise AdapterDtypeError(
                path,
                f"tensor {e.name!r} has dtype {e.dtype}; adapters must be one of "
                f"{', '.join(sorted(ALLOWED_DTYPES))}",
            )
        info = TensorInfo(e.name, e.dtype, e.shape, shard, header.data_start + e.begin, e.nbytes)
        halves.setdefault(m.group("module"), {})[m.group("half")] = info
    if not halves:
        raise AdapterTensorError(path, "holds no LoRA tensors")
    if len(halves) * config.pattern_keys > MAX_PATTERN_MATCHES:
        raise AdapterConfigError(
            os.path.join(os.path.dirname(path), "adapter_config.json"),
            f"{config.pattern_keys} rank_pattern/alpha_pattern keys for {len(halves)} modules "
            f"are more than {MAX_PATTERN_MATCHES} regex matches (PEFT tries every key on "
            "every module)",
        )
    found: dict[str, AdapterModule] = {}
    for module, pair in halves.items():
        for half in ("lora_A", "lora_B"):
            if half not in pair:
                other = next(iter(pair.values())).name
                raise AdapterTensorError(
                    path, f"module {module!r} has {other!r} but no {half} weight"
                )
        found[module] = _check_pair(path, module, pair["lora_A"], pair["lora_B"], config, base)
    order: Mapping[str, int] = {n: i for i, n in enumerate(base.tensors)}
    return tuple(sorted(found.values(), key=lambda m: order[m.base_tensor]))


def _check_pair(
    path: str, module: str, a: TensorInfo, b: TensorInfo, config: AdapterConfig, base: Checkpoint
) -> AdapterModule:
    why = config.why_not(module)
    if why is not None:
        raise AdapterTargetError(path, f"module {module!r} has LoRA weights but {why}")
    base_name = f"{module}.weight"
    t = base.tensors.get(base_name)
    if t is None:
        raise AdapterTargetError(
            path,
            f"target module {module!r}: the base model {base.name!r} has no tensor {base_name!r}",
        )
    if len(t.shape) != 2:
        raise AdapterTargetError(
            path,
            f"target module {module!r}: base tensor {base_name!r} has shape "
            f"{list(t.shape)}, not a 2-D linear weight",
        )
    out, inn = t.shape
    r = config.rank_for(module)
    for info, want in ((a, (r, inn)), (b, (out, r))):
        if len(info.shape) != 2:
            raise AdapterShapeError(
                path, f"tensor {info.name!r}: shape {list(info.shape)} is not 2-D"
            )
        if info.shape != want:
            raise AdapterShapeError(
                path,
                f"tensor {info.name!r}: expected shape {list(want)} (r={r}, base "
                f"{base_name!r} is {list(t.shape)}), got {list(info.shape)}",
            )
    return AdapterModule(module, base_name, r, config.scaling_for(module), a, b)
