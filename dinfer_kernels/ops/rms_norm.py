"""dinfer_kernels.rms_norm, the torch.library op `dinfer::rms_norm`.
Contract: dinfer_kernels/reference/rms_norm.py. Backends: triton (the GPU path),
cpu (the compiled host kernel) and torch (the reference, on any device)."""

import torch

from .. import _backend, _checks, _dispatch
from ..reference.rms_norm import rms_norm_reference


@_dispatch.op("rms_norm")
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    if backend == "torch":
        return rms_norm_reference(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _backend.impl("rms_norm", backend)(x, weight, out, eps=eps)
    return out


@_rms_norm_op.register_fake
def _(x, weight, eps, backend):
    return torch.empty_like(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    """x [..., D] normalised over D in fp32, rounded to x's dtype, times weight [D]."""
    _checks.tensor("x", x, _checks.FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x: expected at least one dimension")
    _checks.tensor("weight", weight, (x.dtype,), ndim=1, device=x.device)
    _checks.shape("weight", weight, [x.shape[-1]])
    _checks.number("eps", eps, lo=0.0, lo_open=True)
    return _rms_norm_op(x, weight, float(eps), _backend.resolve(backend, x.device, "rms_norm"))
