"""Where a linear module's logical ``[out, in]`` weight lies in each of its tensors. Pure.

Tensor parallelism is defined on the logical weight (column-parallel cuts ``out``,
row-parallel cuts ``in``); quantized formats store that weight in several tensors
whose dimensions are packed, grouped or blocked versions of ``out`` and ``in``:

=================  ===================  ========================  =======================
format             payload              scales / zeros            other
=================  ===================  ========================  =======================
dense              weight [out, in]     —                         bias [out]
GPTQ (AutoGPTQ)    qweight [in/p, out]  scales [in/g, out],       g_idx [in]
                   (packs ``in``)       qzeros [in/g, out/p]
AWQ (GEMM)         qweight [in, out/p]  scales [in/g, out],       —
                   (packs ``out``)      qzeros [in/g, out/p]
FP8 block          weight [out, in]     weight_scale_inv          —
                                        [⌈out/bo⌉, ⌈in/bi⌉]
=================  ===================  ========================  =======================

``p = 32 / bits`` values per int32 word, ``g`` the group size, ``bo x bi`` the scale
block (128 x 128 for DeepSeek-V3). A cut of the logical weight is only meaningful
when every tensor of the module can follow it: boundaries must keep packed words,
groups and scale blocks whole, for *every* tensor of the module, so ranks dequantize
exactly what the whole model would. :func:`geometry` says, for one tensor, which
physical dim carries each logical axis, in what unit, and which alignments a cut
must respect; the planner does the cutting.

GPTQ with ``desc_act`` (act-order) assigns input rows to groups through ``g_idx``
in any order, so a row-parallel rank needs every group's scales and zeros: they
are not cut along ``in`` (vLLM does the same), only ``qweight`` and ``g_idx`` are.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from weightd.common.dtypes import DTYPE_BITS

from ..base.errors import ConfigError, ShardingError, UnsupportedQuantization

#: Tensor names (last dotted component) that only exist in quantized modules.
QUANT_ROLES: Final = frozenset(
    {"qweight", "qzeros", "scales", "g_idx", "weight_scale_inv", "weight_scale", "input_scale"}
)
SUPPORTED_METHODS: Final = ("gptq", "awq", "fp8")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """A checkpoint's ``quantization_config``, as far as slicing is concerned."""

    method: str
    bits: int = 0
    group_size: int = 0  # <= 0: one group spans the whole input dim (per-channel)
    desc_act: bool = False
    block: tuple[int, int] | None = None  # FP8 scale block (out, in)
    problem: str = ""  # non-empty: this scheme cannot be sliced, and why

    @property
    def pack(self) -> int:
        return 32 // self.bits if self.bits else 1

    def label(self) -> str:
        if self.method == "fp8":
            return "fp8" if self.block is None else f"fp8 {self.block[0]}x{self.block[1]} blocks"
        return f"{self.method} {self.bits}-bit group_size {self.group_size}"


def _int_field(qc: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = qc.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(
            "config.json", f"quantization_config.{key} must be an integer, got {value!r}"
        )
    return value


def parse_quantization(config: Mapping[str, Any]) -> QuantScheme | None:
    """The scheme named by ``config["quantization_config"]``, or None when unquantized."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError("config.json", "quantization_config must be an object")
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ConfigError("config.json", f"quantization_config.quant_method is {method!r}")
    method = method.lower()
    if method in ("gptq", "awq"):
        bits = _int_field(qc, "bits", 4 if method == "awq" else None)
        group = _int_field(qc, "group_size", -1)
        problem = ""
        if bits not in (2, 4, 8) or (method == "awq" and bits != 4):
            problem = f"{method} with bits={bits} (packing is defined here for 2, 4, 8 / AWQ 4)"
        elif group == 0 or (group > 0 and group % (32 // bits)):
            problem = f"{method} group_size {group} is not a multiple of {32 // bits}"
        fmt = qc.get("checkpoint_format", qc.get("version", "gptq" if method == "gptq" else "gemm"))
        if isinstance(fmt, str) and fmt.lower() not in ("gptq", "gptq_v2", "gemm"):
            problem = f"{method} checkpoint format {fmt!r} (only gptq, gptq_v2 and AWQ gemm)"
        if qc.get("is_marlin_format"):  # AutoGPTQ's Marlin tiles are not row-major [in/8, out]
            problem = f"{method} checkpoint format 'marlin' (only gptq, gptq_v2 and AWQ gemm)"
        desc = qc.get("desc_act", False)
        if not isinstance(desc, bool):
            raise ConfigError("config.json", f"quantization_config.desc_act is {desc!r}")
        return QuantScheme(method, bits, group, desc_act=desc, problem=problem)
    if method == "fp8":
        raw = qc.get("weight_block_size")
        if raw is None:
            return QuantScheme("fp8")
        if (
            not isinstance(raw, list)
            or len(raw) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in raw)
        ):
            raise ConfigError(
                "config.json",
                f"quantization_config.weight_block_size must be two positive integers, got {raw!r}",
            )
        return QuantScheme("fp8", block=(raw[0], raw[1]))
    return QuantScheme(method, problem=f"quantization method {method!r}")


@dataclass(frozen=True, slots=True)
class Axis:
    """Where one logical axis lives in a physical tensor.

    ``dim`` None: the tensor does not vary along the axis (a cut leaves it whole), or,
    with ``missing``, it lacks the axis (a cut along it is an error).
    """

    dim: int | None
    unit: int = 1  # logical elements per physical index
    ceil: bool = False  # the last index may cover a partial unit (FP8 blocks)
    missing: bool = False


@dataclass(frozen=True, slots=True)
class Align:
    unit: int
    what: str  # "a packed int32 word (8 4-bit values)", "a quantization group", ...


@dataclass(frozen=True, slots=True)
class Geometry:
    """One tensor's view of its module's logical ``[out, in]`` weight."""

    out: Axis
    inn: Axis
    out_size: int
    in_size: int
    label: str  # "dense", "gptq 4-bit group_size 128", ...
    out_align: tuple[Align, ...] = ()
    in_align: tuple[Align, ...] = ()


def role_of(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _dense(shape: tuple[int, ...]) -> Geometry:
    out = Axis(0) if len(shape) >= 1 else Axis(None, missing=True)
    inn = Axis(1) if len(shape) >= 2 else Axis(None, missing=True)
    return Geometry(out, inn, shape[0] if shape else 1, shape[1] if len(shape) > 1 else 1, "dense")


def _sibling(name: str, role: str, tensors: Mapping[str, Any]) -> Any:
    prefix = name.rsplit(".", 1)[0]
    return tensors.get(f"{prefix}.{role}")


def _expect(name: str, shape: tuple[int, ...], want: tuple[int, ...], what: str) -> None:
    if tuple(shape) != want:
        raise ShardingError(
            f"tensor {name!r}: shape {list(shape)} disagrees with {what} {list(want)}"
        )


def geometry(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    tensors: Mapping[str, Any],
    scheme: QuantScheme | None,
) -> Geometry:
    """How tensor ``name`` (of ``shape``, per expert when stacked) maps ``[out, in]``.

    ``tensors`` maps names to objects with ``.shape`` (the checkpoint's tensors): a
    quantized tensor's logical sizes come from its module's payload tensor.
    """
    role = role_of(name)
    fp8_scale = _sibling(name, "weight_scale_inv", tensors)
    if role in ("weight_scale", "input_scale") and math.prod(shape) == 1:
        return Geometry(Axis(None), Axis(None), 1, 1, "scalar scale")
    quantized = role in QUANT_ROLES or (role == "weight" and fp8_scale is not None)
    if role == "bias" and (fp8_scale is not None or _sibling(name, "qweight", tensors) is not None):
        quantized = True
    if not quantized:
        return _dense(shape)
    if scheme is None:
        raise ShardingError(
            f"tensor {name!r} is quantized ({role}) but config.json has no quantization_config "
            "saying how it is packed"
        )
    if scheme.problem:
        raise UnsupportedQuantization(
            f"tensor {name!r}: slicing is not supported for {scheme.problem}; only tensor-, "
            "pipeline- and expert-parallel size 1 is served"
        )
    if scheme.method in ("gptq", "awq"):
        return _packed_int(name, role, shape, tensors, scheme)
    return _fp8(name, role, dtype, shape, tensors, scheme)


def _packed_int(
    name: str, role: str, shape: tuple[int, ...], tensors: Mapping[str, Any], s: QuantScheme
) -> Geometry:
    q = _sibling(name, "qweight", tensors)
    if q is None or len(q.shape) != 2:
        raise ShardingError(
            f"tensor {name!r}: its module has no 2-D qweight to take the {s.method} layout from"
        )
    p = s.pack
    if s.method == "gptq":
        k, n = q.shape[0] * p, q.shape[1]
    else:
        k, n = q.shape[0], q.shape[1] * p
    if n % p:
        raise ShardingError(
            f"tensor {name!r}: output dim {n} is not a multiple of the {p} values per int32 word"
        )
    g = s.group_size if s.group_size > 0 else k
    if k % g:
        raise ShardingError(
            f"tensor {name!r}: input dim {k} is not a multiple of group_size {s.group_size}"
        )
    groups = k // g
    label = s.label()
    word = Align(p, f"a packed int32 word ({p} {s.bits}-bit values)")
    group_align = Align(g, f"a quantization group (group_size {s.group_size})")
    grouped_in = s.group_size > 0 and not (s.method == "gptq" and s.desc_act)
    out_align = (word,)
    if s.method == "gptq":
        in_align: tuple[Align, ...] = (word, group_align) if grouped_in else (word,)
    else:
        in_align = (group_align,) if grouped_in else ()
    in_groups = Axis(0, g) if grouped_in else Axis(None)
    if role == "qweight":
        if s.method == "gptq":
            out, inn = Axis(1), Axis(0, p)
        else:
            out, inn = Axis(1, p), Axis(0)
    elif role == "qzeros":
        _expect(name, shape, (groups, n // p), f"{label} qzeros [in/group, out/{p}] =")
        out, inn = Axis(1, p), in_groups
    elif role == "scales":
        _expect(name, shape, (groups, n), f"{label} scales [in/group, out] =")
        out, inn = Axis(1), in_groups
    elif role == "g_idx":
        _expect(name, shape, (k,), f"{label} g_idx [in] =")
        out, inn = Axis(None), Axis(0)
    elif role == "bias":
        _expect(name, shape, (n,), f"{label} bias [out] =")
        out, inn = Axis(0), Axis(None, missing=True)
    else:
        raise ShardingError(f"tensor {name!r}: {role!r} is not part of a {s.method} module")
    return Geometry(out, inn, n, k, label, out_align, in_align)


def _fp8(
    name: str,
    role: str,
    dtype: str,
    shape: tuple[int, ...],
    tensors: Mapping[str, Any],
    s: QuantScheme,
) -> Geometry:
    if role == "weight":
        weight_shape = shape
    else:
        w = _sibling(name, "weight", tensors)
        if w is None:
            raise ShardingError(f"tensor {name!r}: its module has no weight for its {role}")
        weight_shape = tuple(w.shape)
    if len(weight_shape) != 2:
        raise ShardingError(f"tensor {name!r}: an fp8 weight must be 2-D, not {list(weight_shape)}")
    n, k = weight_shape
    if s.block is None:
        if role in ("weight_scale", "input_scale") and tuple(shape) in ((n,), (n, 1)):
            return Geometry(Axis(0), Axis(None), n, k, s.label())
        if role == "weight":
            return Geometry(Axis(0), Axis(1), n, k, s.label())
        raise ShardingError(
            f"tensor {name!r}: {role} of shape {list(shape)} has no known fp8 layout"
        )
    bo, bi = s.block
    label = s.label()
    out_align = (Align(bo, f"an fp8 {bo}x{bi} scale block"),)
    in_align = (Align(bi, f"an fp8 {bo}x{bi} scale block"),)
    if role == "weight":
        if DTYPE_BITS.get(dtype) != 8:
            raise ShardingError(
                f"tensor {name!r}: an fp8 block-scaled weight is {dtype}, not 8-bit"
            )
        return Geometry(Axis(0), Axis(1), n, k, label, out_align, in_align)
    if role == "weight_scale_inv":
        _expect(name, shape, (-(-n // bo), -(-k // bi)), f"{label} weight_scale_inv =")
        return Geometry(
            Axis(0, bo, ceil=True), Axis(1, bi, ceil=True), n, k, label, out_align, in_align
        )
    if role == "bias":
        return Geometry(Axis(0), Axis(None, missing=True), n, k, label, out_align)
    raise ShardingError(f"tensor {name!r}: {role!r} is not part of an fp8 block-scaled module")
