"""dinfer_kernels.rope, the torch.library op `dinfer::rope` (rotate-half rotary embedding at each row's
own absolute position). Contract: dinfer_kernels/reference/rope.py. Backends: triton (the GPU path),
cpu (the compiled host kernel) and torch (the reference, on any device). rope_table: the cos / sin
table of positions [0, P) that dinfer_kernels.qk_rope reads."""

from typing import Optional

import torch

from .. import _backend, _checks, _dispatch
from ..reference.rope import cos_sin_table, rope_reference


@_dispatch.op("rope")
def _rope_op(
    x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int, backend: str
) -> torch.Tensor:
    if backend == "torch":
        return rope_reference(x, positions, theta, rotary_dim)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _backend.impl("rope", backend)(x, positions, out, theta=theta, rotary_dim=rotary_dim)
    return out


@_rope_op.register_fake
def _(x, positions, theta, rotary_dim, backend):
    return torch.empty_like(x)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    rotary_dim: Optional[int] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """x [B, T, H, D] rotated at positions [B, T]; the first rotary_dim (default D) dims rotate."""
    _checks.tensor("x", x, _checks.FLOAT_DTYPES, ndim=4)
    B, T, _, D = x.shape
    _checks.tensor("positions", positions, (torch.int64, torch.int32), ndim=2, device=x.device)
    _checks.shape("positions", positions, [B, T])
    if positions.numel() and _checks.data_checks_possible(positions) and int(positions.min()) < 0:
        raise ValueError(f"positions: must be >= 0, got {int(positions.min())}")
    _checks.number("theta", theta, lo=0.0, lo_open=True)
    rd = D if rotary_dim is None else _checks.integer("rotary_dim", rotary_dim, 2, D + 1)
    if rd % 2:
        raise ValueError(f"rotary_dim: must be even, got {rd}")
    return _rope_op(x, positions, float(theta), rd, _backend.resolve(backend, x.device, "rope"))


def rope_table(theta: float, rotary_dim: int, max_positions: int, device=None) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32 on `device`: row p holds cos, then sin, of position p's
    angles, with the reference's own fp32 formula (reference/rope.py's cos_sin_table of
    arange(max_positions)), so that qk_rope's kernels, which gather rows of it, compute the values
    of the reference bit for bit. A model builds it once for the positions its caches can hold."""
    _checks.number("theta", theta, lo=0.0, lo_open=True)
    rd = _checks.integer("rotary_dim", rotary_dim, 2)
    if rd % 2:
        raise ValueError(f"rotary_dim: must be even, got {rd}")
    P = _checks.integer("max_positions", max_positions, 0)
    return cos_sin_table(torch.arange(P, device=device), float(theta), rd)
