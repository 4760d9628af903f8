"""Checking tensors against the parameters ``config.json`` implies. Pure: no I/O.

A checkpoint can be perfectly well formed and still not be the model its config
describes: a layer missing, a stray tensor, a projection stored transposed, weights
in float32 under a config that says bfloat16 (a loader would silently cast). Each
architecture family registers a function that derives, from the config, the exact
parameter set and shapes (:class:`Layout`); :func:`check_layout` compares the
checkpoint with it and returns every difference as a typed error.

What shape checks cannot catch: a *square* matrix stored transposed (``[h, h]``
either way), or any swap of two tensors of equal shape (``q_proj`` and ``o_proj``
in an MHA model, two layers exchanged). Only digests catch those: a manifest's
per-tensor digest pins each name to its bytes.

Architectures without a registered family are not shape-checked; the report says
so (a note, not a problem). To add a family, write a ``Layout`` function and
:func:`register` it under its ``architectures`` names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from ..base.errors import (
    CheckpointError,
    ConfigFieldError,
    MissingTensorError,
    TensorDtypeError,
    TensorShapeError,
    UnexpectedTensorError,
)
from .description import CONFIG_FILE, TensorInfo

#: ``torch_dtype`` / ``dtype`` spellings in config.json, as safetensors dtypes.
CONFIG_DTYPES: Final[dict[str, str]] = {
    "float32": "F32",
    "float": "F32",
    "float16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "double": "F64",
}
#: Bound on layers, so a hostile config cannot make the expected set exhaust memory.
MAX_LAYERS: Final = 100_000


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter the config implies, and the config fields that fix its shape."""

    shape: tuple[int, ...]
    because: str  # e.g. "intermediate_size x hidden_size"
    optional: bool = False  # may be absent (an lm_head tied to the embeddings)


@dataclass(frozen=True)
class Layout:
    """Every parameter name an architecture has under one config, with its shape."""

    architecture: str
    family: str
    params: Mapping[str, Param]
    #: Names a checkpoint may carry that are not parameters (old rotary buffers).
    extra_allowed: tuple[re.Pattern[str], ...] = ()
    #: The config fields that decided which optional blocks exist, for messages.
    flags: Mapping[str, object] = field(default_factory=dict)


LayoutFn = Callable[[str, str, Mapping[str, Any]], Layout]
_FAMILIES: dict[str, LayoutFn] = {}


def register(architectures: Iterable[str], fn: LayoutFn) -> None:
    """Make ``fn(config_path, architecture, config)`` the layout of these architectures."""
    for arch in architectures:
        _FAMILIES[arch] = fn


def layout_function(config: Mapping[str, Any]) -> tuple[str, LayoutFn | None]:
    archs = config.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    return arch, _FAMILIES.get(arch)


# --- reading config fields ----------------------------------------------------------


def positive_int(path: str, config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        got = "missing" if key not in config else repr(value)
        raise ConfigFieldError(path, f"field {key!r} must be a positive integer, got {got}")
    return value


def flag(path: str, config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, bool):
        raise ConfigFieldError(path, f"field {key!r} must be true or false, got {value!r}")
    return value


def config_dtype(path: str, config: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field name, safetensors dtype) from ``dtype`` (transformers 5) or ``torch_dtype``."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConfigFieldError(path, f"field {key!r} must be a string, got {value!r}")
        name = value.removeprefix("torch.")
        if name == "auto":
            return None
        if name not in CONFIG_DTYPES:
            raise ConfigFieldError(
                path, f"field {key!r} is {value!r}, not one of {', '.join(sorted(CONFIG_DTYPES))}"
            )
        return key, CONFIG_DTYPES[name]
    return None


# --- the Llama family (Llama, Mistral, Qwen2, Qwen3) --------------------------------


@dataclass(frozen=True, slots=True)
class _LlamaVariant:
    qkv_bias: str | bool  # a config flag name, or a fixed answer
    o_bias: str | bool
    mlp_bias: str | bool
    qk_norm: bool
    #: head_dim when config.json has none: None means hidden_size // num_attention_heads
    #: (transformers' Qwen3Config instead defaults to 128).
    default_head_dim: int | None = None


_LLAMA_VARIANTS: Final[dict[str, _LlamaVariant]] = {
    "Llama": _LlamaVariant("attention_bias", "attention_bias", "mlp_bias", qk_norm=False),
    "Mistral": _LlamaVariant(False, False, False, qk_norm=False),
    "Qwen2": _LlamaVariant(True, False, False, qk_norm=False),
    "Qwen3": _LlamaVariant(
        "attention_bias", "attention_bias", False, qk_norm=True, default_head_dim=128
    ),
}


def llama_family_layout(path: str, architecture: str, config: Mapping[str, Any]) -> Layout:
    """Parameter names and shapes of ``{Llama,Mistral,Qwen2,Qwen3}For{CausalLM,Model}``."""
    base = architecture.removesuffix("ForCausalLM").removesuffix("Model")
    variant = _LLAMA_VARIANTS[base]
    causal = architecture.endswith("ForCausalLM")
    hidden = positive_int(path, config, "hidden_size")
    inter = positive_int(path, config, "intermediate_size")
    layers = positive_int(path, config, "num_hidden_layers")
    vocab = positive_int(path, config, "vocab_size")
    heads = positive_int(path, config, "num_attention_heads")
    kv = positive_int(path, config, "num_key_value_heads", heads)
    if heads % kv:
        raise ConfigFieldError(
            path,
            f"field 'num_attention_heads' ({heads}) is not a multiple of "
            f"'num_key_value_heads' ({kv})",
        )
    default_head_dim = variant.default_head_dim
    if default_head_dim is None:
        if config.get("head_dim") is None and hidden % heads:
            raise ConfigFieldError(
                path,
                f"field 'head_dim' is absent and 'hidden_size' ({hidden}) is not a multiple of "
                f"'num_attention_heads' ({heads})",
            )
        default_head_dim = hidden // heads
    head_dim = positive_int(path, config, "head_dim", default_head_dim)
    if layers > MAX_LAYERS:
        raise ConfigFieldError(path, f"field 'num_hidden_layers' is {layers} (limit {MAX_LAYERS})")
    flags: dict[str, object] = {}

    def resolve(choice: str | bool) -> bool:
        if isinstance(choice, bool):
            return choice
        flags[choice] = value = flag(path, config, choice, False)
        return value

    qkv_bias, o_bias, mlp_bias = (
        resolve(variant.qkv_bias),
        resolve(variant.o_bias),
        resolve(variant.mlp_bias),
    )
    tied = flag(path, config, "tie_word_embeddings", False)
    flags["tie_word_embeddings"] = tied
    q, kvd = heads * head_dim, kv * head_dim
    qf = "num_attention_heads*head_dim"
    kf = "num_key_value_heads*head_dim"
    pre = "model." if causal else ""
    params: dict[str, Param] = {
        f"{pre}embed_tokens.weight": Param((vocab, hidden), "vocab_size x hidden_size")
    }
    for i in range(layers):
        p = f"{pre}layers.{i}."
        params[p + "input_layernorm.weight"] = Param((hidden,), "hidden_size")
        params[p + "post_attention_layernorm.weight"] = Param((hidden,), "hidden_size")
        params[p + "self_attn.q_proj.weight"] = Param((q, hidden), f"{qf} x hidden_size")
        params[p + "self_attn.k_proj.weight"] = Param((kvd, hidden), f"{kf} x hidden_size")
        params[p + "self_attn.v_proj.weight"] = Param((kvd, hidden), f"{kf} x hidden_size")
        params[p + "self_attn.o_proj.weight"] = Param((hidden, q), f"hidden_size x {qf}")
        if qkv_bias:
            params[p + "self_attn.q_proj.bias"] = Param((q,), qf)
            params[p + "self_attn.k_proj.bias"] = Param((kvd,), kf)
            params[p + "self_attn.v_proj.bias"] = Param((kvd,), kf)
        if o_bias:
            params[p + "self_attn.o_proj.bias"] = Param((hidden,), "hidden_size")
        if variant.qk_norm:
            params[p + "self_attn.q_norm.weight"] = Param((head_dim,), "head_dim")
            params[p + "self_attn.k_norm.weight"] = Param((head_dim,), "head_dim")
        params[p + "mlp.gate_proj.weight"] = Param(
            (inter, hidden), "intermediate_size x hidden_size"
        )
        params[p + "mlp.up_proj.weight"] = Param((inter, hidden), "intermediate_size x hidden_size")
        params[p + "mlp.down_proj.weight"] = Param(
            (hidden, inter), "hidden_size x intermediate_size"
        )
        if mlp_bias:
            params[p + "mlp.gate_proj.bias"] = Param((inter,), "intermediate_size")
            params[p + "mlp.up_proj.bias"] = Param((inter,), "intermediate_size")
            params[p + "mlp.down_proj.bias"] = Param((hidden,), "hidden_size")
    params[f"{pre}norm.weight"] = Param((hidden,), "hidden_size")
    if causal:
        # Tied: transformers saves no lm_head, but some tools write the tied copy anyway.
        params["lm_head.weight"] = Param((vocab, hidden), "vocab_size x hidden_size", tied)
    rotary = re.compile(rf"^{re.escape(pre)}layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
    return Layout(architecture, "llama", params, (rotary,), flags)


register(
    [f"{base}{head}" for base in _LLAMA_VARIANTS for head in ("ForCausalLM", "Model")],
    llama_family_layout,
)


# --- the check ------------------------------------------------------------------------


@dataclass
class LayoutReport:
    problems: list[CheckpointError]
    notes: list[str]
    layout: Layout | None = None


def check_layout(
    root: str, config: Mapping[str, Any], tensors: Mapping[str, TensorInfo]
) -> LayoutReport:
    """Every way ``tensors`` differ from the parameters ``config`` implies."""
    path = f"{root}/{CONFIG_FILE}"
    report = LayoutReport([], [])
    arch, fn = layout_function(config)
    if config.get("quantization_config") is not None:
        report.notes.append("quantization_config present: parameter names and shapes not checked")
    elif fn is None:
        report.notes.append(
            f"architecture {arch or '(none)'!r} has no registered layout: "
            "parameter names and shapes not checked"
        )
    else:
        try:
            report.layout = fn(path, arch, config)
        except ConfigFieldError as exc:
            report.problems.append(exc)
    report.problems.extend(_check_dtypes(root, config, tensors, report))
    layout = report.layout
    if layout is None:
        return report
    required = sum(1 for p in layout.params.values() if not p.optional)
    if required > 4 * len(tensors) + 1024:
        report.problems.append(
            ConfigFieldError(
                path,
                f"field 'num_hidden_layers' implies {required} parameters for {arch}, "
                f"the checkpoint has {len(tensors)} tensors",
            )
        )
        return report
    report.problems.extend(compare_layout(root, layout, tensors))
    return report


def _check_dtypes(
    root: str, config: Mapping[str, Any], tensors: Mapping[str, TensorInfo], report: LayoutReport
) -> list[CheckpointError]:
    try:
        dtype = config_dtype(f"{root}/{CONFIG_FILE}", config)
    except ConfigFieldError as exc:
        return [exc]
    if dtype is None:
        report.notes.append("config.json names no dtype: tensor dtypes not checked")
        return []
    key, want = dtype
    extra = report.layout.extra_allowed if report.layout else ()
    return [
        TensorDtypeError(
            f"{root}/{t.shard}",
            f"tensor {t.name!r}: dtype {t.dtype} differs from config.json "
            f"{key}={config[key]!r} ({want}); weightd never casts",
        )
        for t in tensors.values()
        if t.dtype != want and not any(p.match(t.name) for p in extra)
    ]


def compare_layout(
    root: str, layout: Layout, tensors: Mapping[str, TensorInfo]
) -> list[CheckpointError]:
    """Missing, unexpected and misshapen tensors, in checkpoint then config order."""
    path = f"{root}/{CONFIG_FILE}"
    problems: list[CheckpointError] = []
    flags = ", ".join(f"{k}={v}" for k, v in layout.flags.items())
    for t in tensors.values():
        where = f"{root}/{t.shard}"
        param = layout.params.get(t.name)
        if param is None:
            if not any(p.match(t.name) for p in layout.extra_allowed):
                problems.append(
                    UnexpectedTensorError(
                        where,
                        f"tensor {t.name!r} is not a parameter of {layout.architecture} "
                        f"as config.json describes it ({flags})",
                    )
                )
            continue
        if t.shape == param.shape:
            continue
        if len(t.shape) == 2 and t.shape == param.shape[::-1]:
            what = f"is the transpose of {list(param.shape)}"
        else:
            what = f"differs from {list(param.shape)}"
        problems.append(
            TensorShapeError(
                where,
                f"tensor {t.name!r}: shape {list(t.shape)} {what}, which config.json implies "
                f"({param.because})",
            )
        )
    for name, param in layout.params.items():
        if name not in tensors and not param.optional:
            problems.append(
                MissingTensorError(
                    path,
                    f"tensor {name!r} {list(param.shape)} ({param.because}) is in no shard",
                )
            )
    return problems
