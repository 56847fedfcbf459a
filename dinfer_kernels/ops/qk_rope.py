"""dinfer_kernels.qk_rope, the torch.library op `dinfer::qk_rope`: an attention's q and k rotated at
their rows' positions, with the angles gathered from a table built once (dinfer_kernels.rope_table),
optionally RMS-normalised over the head dim first (QK-norm). Contract:
dinfer_kernels/reference/qk_rope.py. Backends: triton (the GPU path: one launch for q and k, the
QK-norm fused into it, capturable), cpu (the compiled rms_norm and rope host kernels, reading the given
table) and torch (the reference, on any device)."""

from typing import Optional

import torch

from .. import _backend, _checks, _dispatch
from ..reference.qk_rope import qk_rope_reference


@_dispatch.op("qk_rope")
def _qk_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    q_norm: Optional[torch.Tensor],
    k_norm: Optional[torch.Tensor],
    eps: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "torch":
        return qk_rope_reference(q, k, positions, table, q_norm, k_norm, eps)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _backend.impl("qk_rope", backend)(q, k, positions, table, q_norm, k_norm, q_out, k_out, eps=eps)
    return q_out, k_out


@_qk_rope_op.register_fake
def _(q, k, positions, table, q_norm, k_norm, eps, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def qk_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    table: torch.Tensor,
    *,
    q_norm: Optional[torch.Tensor] = None,
    k_norm: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out): q [B, T, Hq, D] and k [B, T, Hk, D] (one float dtype) rotated at positions
    [B, T] (int64 or int32, in [0, P)) with the angles of table [P, rotary_dim] fp32
    (dinfer_kernels.rope_table(theta, rotary_dim, P): rotary_dim is the table's second dim); with
    q_norm and k_norm [D] (q's dtype, both or neither) each head is first RMS-normalised over D with
    eps. Equals rms_norm then rope of each (reference/qk_rope.py). Positions are checked against the
    table where reading them is free (host tensors); on a GPU the triton backend reads cos = sin = 0 for
    a position outside it (never out of bounds), the torch backend raises a device-side assert. On a
    GPU the fused QK-norm is close to, not bit-equal with, rms_norm then rope (Triton's 1 / sqrt)."""
    _checks.tensor("q", q, _checks.FLOAT_DTYPES, ndim=4)
    B, T, _, D = q.shape
    dev = q.device
    _checks.tensor("k", k, (q.dtype,), ndim=4, device=dev)
    _checks.shape("k", k, [B, T, k.shape[2], D])
    _checks.tensor("positions", positions, (torch.int64, torch.int32), ndim=2, device=dev)
    _checks.shape("positions", positions, [B, T])
    _checks.tensor("table", table, (torch.float32,), ndim=2, device=dev)
    _checks.contiguous("table", table)
    P, rd = table.shape
    if rd < 2 or rd % 2 or rd > D:
        raise ValueError(f"table: its second dim (rotary_dim, {rd}) must be even and in [2, D={D}]")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm, k_norm: QK-norm takes both weights or neither")
    if q_norm is not None:
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            _checks.tensor(name, w, (q.dtype,), ndim=1, device=dev)
            _checks.shape(name, w, [D])
        eps = _checks.number("eps", eps, lo=0.0, lo_open=True)
    if positions.numel() and _checks.data_checks_possible(positions):
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= P:
            raise ValueError(f"positions: must be in [0, {P}) (the table's rows), got range [{lo}, {hi}]")
    backend = _backend.resolve(backend, dev, "qk_rope")
    eps = eps if q_norm is not None else 0.0  # unused without the weights
    return _qk_rope_op(q, k, positions, table, q_norm, k_norm, eps, backend)
