"""FP8 (e4m3) weights with 128 x 128 block scales, the layout released FP8 checkpoints use (HF's
"fine-grained FP8": `weight_scale_inv` [cdiv(out, 128), cdiv(in, 128)], dequantised as q * scale).

The MoE op reads expert weights in this form (W8A16: activations stay bf16 / fp16 / fp32). A stack of
gate and up projections ([..., 2I, K], as w13 keeps them) gives each half its own block grid
(`halves=2`), so the scales of a checkpoint's gate_proj and up_proj stack without re-blocking when I is
not a multiple of 128.

    dequantised[n, k] = (float(q[n, k]) * scale[block(n), k // 128]).to(dtype)

the fp32 product rounded once to the activation dtype (every backend dequantises this way, so an FP8
call equals the same call on the dequantised weights).
"""

from typing import Tuple

import torch

from . import _checks

FP8_BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_scale_shape(rows: int, cols: int, halves: int = 1) -> Tuple[int, int]:
    """The [row blocks, column blocks] of the scales of a [rows, cols] weight (halves=2: a gate/up stack,
    each half of rows / 2 blocked on its own)."""
    return halves * _cdiv(rows // halves, FP8_BLOCK), _cdiv(cols, FP8_BLOCK)


def _halves(name: str, w: torch.Tensor, halves: int) -> int:
    halves = _checks.integer("halves", halves, 1, 3)
    if w.dim() < 2:
        raise ValueError(f"{name}: expected [..., N, K], got {tuple(w.shape)}")
    if w.shape[-2] % halves:
        raise ValueError(f"{name}: {w.shape[-2]} rows do not split into {halves} halves")
    return halves


def _row_blocks(rows: int, halves: int, device) -> torch.Tensor:
    """The scale row of each weight row (its half's own block grid)."""
    half = rows // halves
    r = torch.arange(rows, device=device)
    return (r // half) * _cdiv(half, FP8_BLOCK) + (r % half) // FP8_BLOCK


def _expand(scale: torch.Tensor, rows: int, cols: int, halves: int) -> torch.Tensor:
    """The scales broadcast to one per weight element, [..., rows, cols]."""
    per_row = scale.index_select(-2, _row_blocks(rows, halves, scale.device))
    return per_row.index_select(-1, torch.arange(cols, device=scale.device) // FP8_BLOCK)


def fp8_block_quantize(w: torch.Tensor, *, halves: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [..., N, K], scale fp32 [..., halves * cdiv(N / halves, 128), cdiv(K, 128)]) of a
    float weight [..., N, K]: each 128 x 128 block scaled by absmax / 448 (an all-zero block: scale 1),
    rounded to nearest e4m3."""
    _checks.tensor("w", w, _checks.FLOAT_DTYPES)
    halves = _halves("w", w, halves)
    rows, cols = w.shape[-2:]
    sr, sc = fp8_scale_shape(rows, cols, halves)
    lead = w.shape[:-2]
    absmax = torch.zeros(*lead, sr, sc, dtype=torch.float32, device=w.device)
    # amax of each block: a scatter-reduce over the element -> block map (any shape, no padding copy).
    row_b = _row_blocks(rows, halves, w.device)
    col_b = torch.arange(cols, device=w.device) // FP8_BLOCK
    block = (row_b[:, None] * sc + col_b[None, :]).expand(*lead, rows, cols).reshape(*lead, -1)
    absmax = absmax.reshape(*lead, -1).scatter_reduce(
        -1, block, w.float().abs().reshape(*lead, -1), "amax", include_self=True
    )
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax)).reshape(*lead, sr, sc)
    q = (w.float() / _expand(scale, rows, cols, halves)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def check_scale(name: str, scale: torch.Tensor, weight: torch.Tensor, halves: int = 1) -> None:
    """scale: fp32, contiguous, on the weight's device, with the weight's block grid."""
    _checks.tensor(name, scale, (torch.float32,), ndim=weight.dim(), device=weight.device)
    rows, cols = weight.shape[-2:]
    _checks.shape(name, scale, [*weight.shape[:-2], *fp8_scale_shape(rows, cols, halves)])
    _checks.contiguous(name, scale)


def fp8_block_dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, halves: int = 1
) -> torch.Tensor:
    """The weight [..., N, K] in `dtype` that q and its block scales stand for: the fp32 product
    q * scale rounded once to dtype (the rounding every backend's FP8 path uses)."""
    _checks.tensor("q", q, (FP8_DTYPE,))
    halves = _halves("q", q, halves)
    check_scale("scale", scale, q, halves)
    rows, cols = q.shape[-2:]
    return (q.float() * _expand(scale, rows, cols, halves)).to(dtype)
