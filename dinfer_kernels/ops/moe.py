"""dinfer_kernels.moe, the torch.library op `dinfer::moe` (router + top-k + experts + weighted
combine). Contract: dinfer_kernels/reference/moe.py."""
from typing import Optional, Tuple

import torch

from .. import _backend, _checks
from ..reference.moe import moe_reference


@torch.library.custom_op("dinfer::moe", mutates_args=())
def _moe_op(hidden: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            top_k: int, renormalize: bool, expert_bias: Optional[torch.Tensor], e0: int, e1: int,
            backend: str) -> torch.Tensor:
    return moe_reference(hidden, router_weight, w13, w2, top_k, renormalize, expert_bias, (e0, e1))


@_moe_op.register_fake
def _(hidden, router_weight, w13, w2, top_k, renormalize, expert_bias, e0, e1, backend):
    return torch.empty_like(hidden)


def moe(hidden, router_weight, w13, w2, top_k: int, *, renormalize: bool = False,
        expert_bias: Optional[torch.Tensor] = None, expert_range: Optional[Tuple[int, int]] = None,
        backend: str = "auto") -> torch.Tensor:
    """[T, H] output of the routed experts; see the reference docstring."""
    _checks.tensor("hidden", hidden, _checks.FLOAT_DTYPES, ndim=2)
    dev = hidden.device
    T, H = hidden.shape
    _checks.tensor("w13", w13, (hidden.dtype,), ndim=3, device=dev)
    E, two_i = w13.shape[0], w13.shape[1]
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13: the middle dimension is gate + up rows (2 * I), got {two_i}")
    _checks.shape("w13", w13, [E, two_i, H])
    _checks.tensor("w2", w2, (hidden.dtype,), ndim=3, device=dev)
    _checks.shape("w2", w2, [E, H, two_i // 2])
    _checks.tensor("router_weight", router_weight, _checks.FLOAT_DTYPES, ndim=2, device=dev)
    _checks.shape("router_weight", router_weight, [E, H])
    _checks.integer("top_k", top_k, 1, E + 1)
    if expert_bias is not None:
        _checks.tensor("expert_bias", expert_bias, _checks.FLOAT_DTYPES, ndim=1, device=dev)
        _checks.shape("expert_bias", expert_bias, [E])
    e0, e1 = (0, E) if expert_range is None else expert_range
    _checks.integer("expert_range[0]", e0, 0, E + 1)
    _checks.integer("expert_range[1]", e1, e0, E + 1)
    return torch.ops.dinfer.moe(hidden, router_weight, w13, w2, top_k, bool(renormalize), expert_bias,
                                e0, e1, _backend.resolve(backend, dev, "moe"))
