"""Parsing PEFT's ``adapter_config.json`` for a LoRA adapter. Pure: bytes in, a config out.

Only what changes the arithmetic a worker must do is kept: ``r`` and ``lora_alpha``
(and their per-module overrides), ``use_rslora`` (the scale ``alpha/sqrt(r)``), which
modules are targeted, and the base model. A feature that would change the
arithmetic in a way weightd does not serve (DoRA's magnitude vectors, trained
biases, whole modules saved beside the LoRA pairs, transposed ``fan_in_fan_out``
layers, ...) is refused by name rather than ignored: an adapter served without its
DoRA magnitudes would load cleanly and compute something else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..base.errors import AdapterConfigError, UnsupportedAdapterFeature
from ..checkpoint.description import strict_json

#: Fields that, when set to anything but their "off" value, mean a feature weightd does
#: not serve. Each maps to the values that count as "off".
_UNSUPPORTED: Final[dict[str, tuple[Any, ...]]] = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "bias": ("none", None),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "layer_replication": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}, []),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (False, None),
}
_WHY: Final = {
    "use_dora": "DoRA (its magnitude vectors change the layer's arithmetic)",
    "modules_to_save": "modules_to_save (whole modules replaced beside the LoRA pairs)",
    "bias": "trained biases",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D-style layers)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters (LoRA on raw parameters, not modules)",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA",
}
#: Largest ``r`` accepted: far above any real adapter, low enough to bound a plan.
MAX_RANK: Final = 65536


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    #: A list of module-name suffixes, or one regular expression over the full name.
    target_modules: tuple[str, ...] | str
    base_model_name_or_path: str | None
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    use_rslora: bool

    def targets(self, module: str) -> bool:
        """Whether PEFT would have put a LoRA pair on ``module`` (its dotted name)."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)

    def rank_for(self, module: str) -> int:
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def alpha_for(self, module: str) -> float:
        return float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))

    def scaling_for(self, module: str) -> float:
        """The factor PEFT multiplies ``B @ A @ x`` by for ``module``."""
        r = self.rank_for(module)
        alpha = self.alpha_for(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _anchored(key: str) -> str:
    """PEFT's expression for a ``rank_pattern``/``alpha_pattern`` key."""
    return rf"(.*\.)?({key})$"


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rule: the first pattern key matching the end of the module name wins."""
    for key, value in patterns.items():
        if re.match(_anchored(key), module):
            return value
    return default


def _number(path: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdapterConfigError(path, f"field {field!r} must be a number, got {value!r}")
    return float(value)


def _rank(path: str, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AdapterConfigError(path, f"field {field!r} must be an integer, got {value!r}")
    if not 0 < value <= MAX_RANK:
        raise AdapterConfigError(path, f"field {field!r} must be in 1..{MAX_RANK}, got {value}")
    return value


def _regex(path: str, what: str, pattern: str) -> None:
    """Compile ``pattern`` exactly as it will be used, or say why not, naming the field.

    ``re`` raises OverflowError (a repeat count over 2**32) and RecursionError (deep
    nesting) besides re.error; all three are a bad config, never a crash of the load.
    """
    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as exc:
        raise AdapterConfigError(path, f"{what} is not a regex: {exc}") from None


def _patterns(path: str, field: str, value: Any, item: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdapterConfigError(path, f"field {field!r} must be an object, got {value!r}")
    out: dict[str, Any] = {}
    for key, v in value.items():
        # Checked inside the expression PEFT (and _pattern_value) builds around it: a key
        # like "(?i)x" compiles alone, but not where its global flag would land.
        _regex(path, f"field {field!r}: key {key!r}", _anchored(key))
        out[key] = item(path, f"{field}[{key!r}]", v)
    return out


def parse_adapter_config(path: str, raw: bytes) -> AdapterConfig:
    """Parse and check ``adapter_config.json``; raise naming the field at fault."""
    doc = strict_json(path, raw, AdapterConfigError)
    peft_type = doc.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise UnsupportedAdapterFeature(
            path, f"peft_type {peft_type!r} is not served; only LoRA adapters (peft_type 'LORA')"
        )
    for key, off in _UNSUPPORTED.items():
        if key in doc and doc[key] not in off:
            raise UnsupportedAdapterFeature(
                path, f"field {key!r} is {doc[key]!r}: {_WHY[key]} is not supported"
            )
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in doc:
            raise AdapterConfigError(path, f"missing field {key!r}")
    r = _rank(path, "r", doc["r"])
    alpha = _number(path, "lora_alpha", doc["lora_alpha"])
    raw_targets = doc["target_modules"]
    targets: tuple[str, ...] | str
    if isinstance(raw_targets, str):
        if raw_targets == "all-linear":
            raise AdapterConfigError(
                path,
                "field 'target_modules' is 'all-linear': save the adapter with the "
                "expanded module list PEFT resolved",
            )
        _regex(path, "field 'target_modules'", raw_targets)
        targets = raw_targets
    elif isinstance(raw_targets, list) and raw_targets:
        if not all(isinstance(t, str) and t for t in raw_targets):
            raise AdapterConfigError(
                path, f"field 'target_modules' must list non-empty names, got {raw_targets!r}"
            )
        targets = tuple(sorted(set(raw_targets)))
    else:
        raise AdapterConfigError(
            path, f"field 'target_modules' must be a non-empty list or a regex, got {raw_targets!r}"
        )
    base = doc.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise AdapterConfigError(
            path, f"field 'base_model_name_or_path' must be a string, got {base!r}"
        )
    rslora = doc.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterConfigError(path, f"field 'use_rslora' must be a boolean, got {rslora!r}")
    return AdapterConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        base_model_name_or_path=base or None,
        rank_pattern=_patterns(path, "rank_pattern", doc.get("rank_pattern"), _rank),
        alpha_pattern=_patterns(path, "alpha_pattern", doc.get("alpha_pattern"), _number),
        use_rslora=rslora,
    )
