"""Synthetic quantized modules in the published formats, and their dequantizers.

Written from the formats' reference code, not from weightd:

* GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format: gptq``): ``qweight`` int32
  ``[in/8, out]`` packs 8 4-bit values of consecutive *input* rows, value ``j`` at bits
  ``4j``; ``qzeros`` int32 ``[groups, out/8]`` packs zeros along *output* columns and
  stores ``zero - 1``; ``scales`` fp16 ``[groups, out]``; ``g_idx`` int32 ``[in]`` gives
  each input row's group (``k // group_size``, or any order with ``desc_act``).
  ``w[k, n] = scales[g, n] * (q[k, n] - (qzeros[g, n] + 1))``, ``g = g_idx[k]``.
* AWQ (AutoAWQ GEMM): ``qweight`` int32 ``[in, out/8]`` packs 8 *output* columns per
  word in the interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]``; ``qzeros`` ``[groups,
  out/8]`` the same way; ``scales`` fp16 ``[groups, out]``;
  ``w[k, n] = (q[k, n] - z[k // g, n]) * scales[k // g, n]``.
* FP8 with block scales (DeepSeek-V3): ``weight`` float8_e4m3fn ``[out, in]`` and
  ``weight_scale_inv`` fp32 ``[ceil(out/128), ceil(in/128)]``;
  ``w[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]``.

Each dequantizer returns the logical ``[out, in]`` float32 weight.
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _words(values: np.ndarray) -> torch.Tensor:
    """Pack ``[..., 8]`` 4-bit values (last axis: slot 0..7) into int32 words."""
    word = np.zeros(values.shape[:-1], dtype=np.uint64)
    for slot in range(8):
        word |= values[..., slot].astype(np.uint64) << np.uint64(4 * slot)
    return torch.from_numpy(word.astype(np.uint32).view(np.int32).copy())


def _unwords(words: torch.Tensor) -> np.ndarray:
    """``[..., W]`` int32 → ``[..., W, 8]`` 4-bit values by slot."""
    w = words.numpy().view(np.uint32).astype(np.uint64)
    return np.stack([(w >> np.uint64(4 * s)) & np.uint64(0xF) for s in range(8)], axis=-1).astype(
        np.int64
    )


def gptq_module(
    out: int, inn: int, group: int, rng: np.random.Generator, *, desc_act: bool = False
) -> dict[str, torch.Tensor]:
    groups = inn // group
    q = rng.integers(0, 16, (inn, out))
    zeros = rng.integers(1, 16, (groups, out))  # stored as zero - 1: keep it >= 0
    g_idx = np.arange(inn) // group
    if desc_act:
        g_idx = rng.permutation(g_idx)
    qweight = _words(q.reshape(inn // 8, 8, out).transpose(0, 2, 1))
    qzeros = _words((zeros - 1).reshape(groups, out // 8, 8))
    scales = torch.from_numpy(rng.uniform(0.01, 0.1, (groups, out)).astype(np.float16))
    return {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scales,
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
        "bias": torch.from_numpy(rng.standard_normal(out).astype(np.float16)),
    }


def gptq_dequant(m: dict[str, torch.Tensor], group: int, desc_act: bool) -> torch.Tensor:
    """Without ``desc_act``, group ``k // group`` of the rows at hand (``g_idx`` is that
    for the whole module; a row-parallel rank's rows start at a group boundary), as
    engines do; with it, ``g_idx`` indexes the module's (unsplit) scales and zeros."""
    q = _unwords(m["qweight"])  # [in/8, out, 8]: input row 8i+j at slot j
    inn8, out, _ = q.shape
    q = q.transpose(0, 2, 1).reshape(inn8 * 8, out)
    z = _unwords(m["qzeros"]).reshape(m["qzeros"].shape[0], -1) + 1  # [groups, out]
    g = m["g_idx"].numpy().astype(np.int64) if desc_act else np.arange(q.shape[0]) // group
    s = m["scales"].float().numpy()
    w = s[g, :] * (q - z[g, :])
    return torch.from_numpy(w.T.astype(np.float32).copy())


def awq_module(out: int, inn: int, group: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    groups = inn // group
    q = rng.integers(0, 16, (inn, out))
    zeros = rng.integers(0, 16, (groups, out))

    def pack(v: np.ndarray) -> torch.Tensor:
        cols = v.reshape(v.shape[0], out // 8, 8)
        return _words(cols[..., list(AWQ_ORDER)])  # slot i holds column 8c + ORDER[i]

    scales = torch.from_numpy(rng.uniform(0.01, 0.1, (groups, out)).astype(np.float16))
    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales}


def awq_dequant(m: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    def unpack(words: torch.Tensor) -> np.ndarray:
        slots = _unwords(words)  # [rows, W, 8] by slot
        cols = np.empty_like(slots)
        cols[..., list(AWQ_ORDER)] = slots
        return cols.reshape(slots.shape[0], -1)

    q, z = unpack(m["qweight"]), unpack(m["qzeros"])
    s = m["scales"].float().numpy()
    g = np.arange(q.shape[0]) // group
    w = (q - z[g, :]) * s[g, :]
    return torch.from_numpy(w.T.astype(np.float32).copy())


def fp8_module(
    out: int, inn: int, rng: np.random.Generator, block: int = 128
) -> dict[str, torch.Tensor]:
    w = torch.from_numpy(rng.uniform(-2, 2, (out, inn)).astype(np.float32))
    scales = rng.uniform(0.5, 2.0, (-(-out // block), -(-inn // block))).astype(np.float32)
    return {"weight": w.to(torch.float8_e4m3fn), "weight_scale_inv": torch.from_numpy(scales)}


def fp8_dequant(m: dict[str, torch.Tensor], block: int = 128) -> torch.Tensor:
    w = m["weight"].float()
    s = m["weight_scale_inv"]
    rows = torch.arange(w.shape[0]) // block
    cols = torch.arange(w.shape[1]) // block
    return w * s[rows][:, cols]
