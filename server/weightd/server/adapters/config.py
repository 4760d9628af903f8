"""Parsing PEFT's ``adapter_config.json`` for a LoRA adapter. Pure: bytes in, a config out.

Every field ``LoraConfig`` saves (peft 0.21) is in exactly one table here:

* **used** — ``r``, ``lora_alpha`` and their per-module overrides (``rank_pattern``,
  ``alpha_pattern``), ``use_rslora`` (scale ``alpha/sqrt(r)``), which modules get a
  pair (``target_modules``, ``exclude_modules``, ``layers_to_transform``,
  ``layers_pattern``: PEFT's rules in :mod:`.targeting`), and the base model;
* **inert** — fields that change neither where LoRA applies nor what a worker
  computes at inference (dropout, the PEFT version, how the pair was initialised
  when that initialisation left the base weights alone, ...);
* **refused unless off** — features that change the arithmetic in a way weightd does
  not serve (DoRA's magnitude vectors, trained biases, whole modules saved beside the
  pairs, transposed ``fan_in_fan_out`` layers, initialisations that rewrite the base
  weights, ...): an adapter served without them would load cleanly and compute
  something else, so it is refused by name.

A field in no table (a newer PEFT's) is refused unless its value is an "off" value
(``null``, ``false``, empty), so nothing that matters is ever silently ignored.
The config's own size is bounded: the file by :data:`MAX_CONFIG_BYTES` (checked
from its size before it is read), each list by :data:`MAX_LIST_ENTRIES`, the pattern
keys by :data:`MAX_PATTERN_KEYS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..base.errors import AdapterConfigError, UnsupportedAdapterFeature
from ..base.patterns import Pattern
from ..checkpoint.description import strict_json
from .targeting import (
    DEFAULT_LAYER_REGEX,
    Keyed,
    Names,
    Targeting,
    compile_field,
    layer_regex,
    pattern_key_regex,
)

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
    "megatron_config": (None, {}),
    "velora_config": (None, {}),
    "monteclora_config": (None, {}),
    "use_bdlora": (None, False, {}),
    "arrow_config": (None, {}),
    "kasa_config": (None, {}),
    "ensure_weight_tying": (False, None),
    # Initialisations that leave the base weights as they are; the others (PiSSA,
    # CorDA, OLoRA, MiCA, LoftQ, LoRA-GA) rewrite them, and weightd serves the base
    # unmodified. (Adapters converted with path_initial_model_for_weight_conversion
    # are saved with init_lora_weights true.)
    "init_lora_weights": (True, False, None, "gaussian", "eva", "orthogonal"),
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
    "megatron_config": "LoRA on Megatron parallel layers (megatron_config)",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "ensure_weight_tying": "ensure_weight_tying (LoRA tied across embedding and head)",
    "init_lora_weights": "an initialisation that rewrites the base weights",
}
#: Fields that change neither where LoRA applies nor the inference arithmetic.
_INERT: Final = frozenset(
    {
        "task_type",
        "auto_mapping",
        "peft_version",
        "revision",
        "inference_mode",
        "lora_dropout",  # dropout is the identity at inference
        "megatron_core",  # a module path, used only with megatron_config (refused)
        "qalora_group_size",  # used only with use_qalora (refused)
        # Parameters of an initialisation (init_lora_weights says which, checked above);
        # the trained pairs are what is saved.
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "runtime_config",
    }
)
_USED: Final = frozenset(
    {
        "peft_type",
        "r",
        "lora_alpha",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
        "use_rslora",
        "base_model_name_or_path",
    }
)
_OFF_VALUES: Final[tuple[Any, ...]] = (None, False, [], {}, "")
#: Largest ``r`` accepted: far above any real adapter, low enough to bound a plan.
MAX_RANK: Final = 65536
#: Largest adapter_config.json read (a real one is kilobytes; 60,000 full module names
#: are about 3 MB).
MAX_CONFIG_BYTES: Final = 4 << 20
#: Entries of target_modules, exclude_modules, layers_to_transform, layers_pattern.
MAX_LIST_ENTRIES: Final = 65536
#: Keys of rank_pattern or alpha_pattern (each is a regex tried against every module).
MAX_PATTERN_KEYS: Final = 1024


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    #: A sorted tuple of module-name suffixes, or one regular expression over the name.
    target_modules: tuple[str, ...] | str
    base_model_name_or_path: str | None
    use_rslora: bool
    #: Where PEFT puts pairs: target_modules, exclude_modules, layers_to_transform/pattern.
    targeting: Targeting = field(repr=False, compare=False)
    rank_pattern: Keyed = field(default_factory=Keyed, repr=False, compare=False)
    alpha_pattern: Keyed = field(default_factory=Keyed, repr=False, compare=False)

    def targets(self, module: str) -> bool:
        """Whether PEFT would have put a LoRA pair on ``module`` (its dotted name)."""
        return self.targeting.why_not(module) is None

    def why_not(self, module: str) -> str | None:
        """None when PEFT puts a pair on ``module``; else why not, naming the field."""
        return self.targeting.why_not(module)

    @property
    def pattern_keys(self) -> int:
        """Regexes tried per module for its ``r`` and ``lora_alpha``."""
        return len(self.rank_pattern.entries) + len(self.alpha_pattern.entries)

    def rank_for(self, module: str) -> int:
        return int(self.rank_pattern.value_for(module, self.r))

    def alpha_for(self, module: str) -> float:
        return float(self.alpha_pattern.value_for(module, self.lora_alpha))

    def scaling_for(self, module: str) -> float:
        """The factor PEFT multiplies ``B @ A @ x`` by for ``module``."""
        r = self.rank_for(module)
        alpha = self.alpha_for(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


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


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:120]}... ({len(text)} characters)"


def _keyed(path: str, field: str, value: Any, item: Any) -> Keyed:
    if value is None:
        return Keyed()
    if not isinstance(value, dict):
        raise AdapterConfigError(path, f"field {field!r} must be an object, got {_shown(value)}")
    if len(value) > MAX_PATTERN_KEYS:
        raise AdapterConfigError(
            path, f"field {field!r} has {len(value)} keys; the limit is {MAX_PATTERN_KEYS}"
        )
    entries = []
    for key, v in value.items():
        # Compiled inside the expression PEFT builds around it: a key like "(?i)x"
        # compiles alone, but not where its global flag would land.
        where = f"{field}[{key[:120]!r}]"
        pattern = compile_field(pattern_key_regex(key), path, where, AdapterConfigError)
        entries.append((key, pattern, item(path, where, v)))
    return Keyed(tuple(entries))


def _names_or_regex(path: str, field: str, value: Any) -> Names | Pattern:
    """A list of module names (a set, as PEFT makes it) or one regex (``fullmatch``)."""
    if isinstance(value, str):
        return compile_field(value, path, field, AdapterConfigError)
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise AdapterConfigError(
            path,
            f"field {field!r} must be a regex or must list non-empty names, got {_shown(value)}",
        )
    if len(value) > MAX_LIST_ENTRIES:
        raise AdapterConfigError(
            path, f"field {field!r} lists {len(value)} names; the limit is {MAX_LIST_ENTRIES}"
        )
    return Names(frozenset(value))


def _targeting(path: str, doc: Mapping[str, Any]) -> tuple[tuple[str, ...] | str, Targeting]:
    raw = doc["target_modules"]
    if raw == "all-linear":
        raise AdapterConfigError(
            path,
            "field 'target_modules' is 'all-linear': save the adapter with the "
            "expanded module list PEFT resolved",
        )
    if isinstance(raw, list) and not raw:
        raise AdapterConfigError(
            path, "field 'target_modules' must be a non-empty list or a regex, got []"
        )
    if not isinstance(raw, str | list):
        raise AdapterConfigError(
            path, f"field 'target_modules' must be a non-empty list or a regex, got {_shown(raw)}"
        )
    targets = _names_or_regex(path, "target_modules", raw)
    excluded = doc.get("exclude_modules")
    exclude = None if not excluded else _names_or_regex(path, "exclude_modules", excluded)
    layers_raw = doc.get("layers_to_transform")
    pattern_raw = doc.get("layers_pattern")
    # LoraConfig's own checks: PEFT refuses these combinations, so they are not adapters.
    if isinstance(raw, str) and layers_raw is not None:
        raise AdapterConfigError(
            path, "field 'layers_to_transform' cannot be used when 'target_modules' is a regex"
        )
    if isinstance(raw, str) and pattern_raw is not None:
        raise AdapterConfigError(
            path, "field 'layers_pattern' cannot be used when 'target_modules' is a regex"
        )
    if pattern_raw and layers_raw is None:
        raise AdapterConfigError(
            path, "field 'layers_pattern' is set but 'layers_to_transform' is not"
        )
    layers: frozenset[int] | None = None
    if isinstance(layers_raw, int) and not isinstance(layers_raw, bool):
        layers = frozenset({layers_raw})
    elif isinstance(layers_raw, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers_raw
    ):
        if len(layers_raw) > MAX_LIST_ENTRIES:
            raise AdapterConfigError(
                path,
                f"field 'layers_to_transform' lists {len(layers_raw)} layers; the limit "
                f"is {MAX_LIST_ENTRIES}",
            )
        layers = frozenset(layers_raw) if layers_raw else None  # [] means every layer
    elif layers_raw is not None:
        raise AdapterConfigError(
            path,
            f"field 'layers_to_transform' must be an integer or a list of them, got "
            f"{_shown(layers_raw)}",
        )
    patterns: list[str] = []
    if isinstance(pattern_raw, str):
        patterns = [pattern_raw] if pattern_raw else []
    elif isinstance(pattern_raw, list) and all(isinstance(p, str) for p in pattern_raw):
        if len(pattern_raw) > MAX_PATTERN_KEYS:
            raise AdapterConfigError(
                path,
                f"field 'layers_pattern' lists {len(pattern_raw)} patterns; the limit "
                f"is {MAX_PATTERN_KEYS}",
            )
        patterns = list(pattern_raw)
    elif pattern_raw is not None:
        raise AdapterConfigError(
            path,
            f"field 'layers_pattern' must be a string or a list of them, got {_shown(pattern_raw)}",
        )
    targeting = Targeting(
        targets,
        exclude,
        layers,
        tuple(
            compile_field(layer_regex(p), path, "layers_pattern", AdapterConfigError)
            for p in patterns
        ),
        compile_field(DEFAULT_LAYER_REGEX, path, "layers_to_transform", AdapterConfigError),
    )
    shown = raw if isinstance(raw, str) else tuple(sorted(set(raw)))
    return shown, targeting


def _check_fields(path: str, doc: Mapping[str, Any]) -> None:
    """Every field is used, inert, or refused unless off; an unknown one must be off."""
    for key, off in _UNSUPPORTED.items():
        if key in doc and not any(doc[key] == v and type(doc[key]) is type(v) for v in off):
            raise UnsupportedAdapterFeature(
                path, f"field {key!r} is {_shown(doc[key])}: {_WHY[key]} is not supported"
            )
    for key, value in doc.items():
        known = key in _USED or key in _INERT or key in _UNSUPPORTED
        if not known and not any(value == v and type(value) is type(v) for v in _OFF_VALUES):
            raise UnsupportedAdapterFeature(
                path,
                f"field {key[:120]!r} is {_shown(value)}: weightd does not know this LoraConfig "
                "field, so cannot tell how it changes where or how LoRA applies",
            )


def parse_adapter_config(path: str, raw: bytes) -> AdapterConfig:
    """Parse and check ``adapter_config.json``; raise naming the field at fault."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterConfigError(path, f"{len(raw)} bytes, over the {MAX_CONFIG_BYTES}-byte limit")
    doc = strict_json(path, raw, AdapterConfigError)
    peft_type = doc.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise UnsupportedAdapterFeature(
            path,
            f"peft_type {_shown(peft_type)} is not served; only LoRA adapters (peft_type 'LORA')",
        )
    _check_fields(path, doc)
    for key in ("r", "lora_alpha", "target_modules"):
        if key not in doc:
            raise AdapterConfigError(path, f"missing field {key!r}")
    r = _rank(path, "r", doc["r"])
    alpha = _number(path, "lora_alpha", doc["lora_alpha"])
    targets, targeting = _targeting(path, doc)
    base = doc.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise AdapterConfigError(
            path, f"field 'base_model_name_or_path' must be a string, got {_shown(base)}"
        )
    rslora = doc.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterConfigError(
            path, f"field 'use_rslora' must be a boolean, got {_shown(rslora)}"
        )
    return AdapterConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        base_model_name_or_path=base or None,
        use_rslora=rslora,
        targeting=targeting,
        rank_pattern=_keyed(path, "rank_pattern", doc.get("rank_pattern"), _rank),
        alpha_pattern=_keyed(path, "alpha_pattern", doc.get("alpha_pattern"), _number),
    )
