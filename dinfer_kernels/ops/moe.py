"""dinfer_kernels.moe, the torch.library op `dinfer::moe` (router + top-k + experts + weighted
combine). Contract: dinfer_kernels/reference/moe.py.

Backends: "cuda" (csrc/moe, when the extension was built with it), "triton"
(dinfer_kernels/triton/moe.py), "cpu" (csrc/moe/moe_cpu.cpp: host arrays) and "torch" (the
reference: rows grouped by expert once, a loop over experts). The cuda and triton backends keep
everything on the device with grids fixed by the shapes, so a call can sit in a CUDA graph; the torch
reference switches to its static-shape path under capture.
"""

from typing import Optional, Tuple

import torch

from .. import _backend, _checks, _dispatch
from ..reference.moe import SCORINGS, moe_reference

_SCORING_CODES = {name: i for i, name in enumerate(SCORINGS)}


@_dispatch.op("moe")
def _moe_op(
    hidden: torch.Tensor,
    router_weight: Optional[torch.Tensor],
    router_logits: Optional[torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: int,
    expert_bias: Optional[torch.Tensor],
    num_groups: int,
    topk_groups: int,
    routed_scaling: float,
    e0: int,
    e1: int,
    backend: str,
) -> torch.Tensor:
    name = SCORINGS[scoring]
    if backend == "torch":
        return moe_reference(
            hidden,
            router_weight,
            w13,
            w2,
            top_k,
            renormalize,
            expert_bias,
            (e0, e1),
            router_logits=router_logits,
            scoring=name,
            num_groups=num_groups,
            topk_groups=topk_groups,
            routed_scaling=routed_scaling,
        )
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    _backend.impl("moe", backend)(
        hidden,
        router_weight,
        router_logits,
        w13,
        w2,
        expert_bias,
        out,
        top_k=top_k,
        renormalize=renormalize,
        scoring=name,
        num_groups=num_groups,
        topk_groups=topk_groups,
        routed_scaling=routed_scaling,
        e0=e0,
        e1=e1,
    )
    return out


@_moe_op.register_fake
def _(
    hidden,
    router_weight,
    router_logits,
    w13,
    w2,
    top_k,
    renormalize,
    scoring,
    expert_bias,
    num_groups,
    topk_groups,
    routed_scaling,
    e0,
    e1,
    backend,
):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


def moe(
    hidden: torch.Tensor,
    router_weight: Optional[torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    *,
    router_logits: Optional[torch.Tensor] = None,
    renormalize: bool = False,
    scoring: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling: float = 1.0,
    expert_range: Optional[Tuple[int, int]] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """[T, H] output of the routed experts, in hidden's dtype; see the reference docstring.

    LLaDA-MoE: moe(h, router_weight, w13, w2, 8) (softmax, no renormalisation).
    LLaDA2:    moe(h, router_weight, w13, w2, 8, scoring="sigmoid", expert_bias=b, num_groups=8,
                   topk_groups=4, renormalize=True, routed_scaling=2.5).
    Exactly one of router_weight [E, H] and router_logits [T, E] is given.
    """
    _checks.tensor("hidden", hidden, _checks.FLOAT_DTYPES, ndim=2)
    dev = hidden.device
    T, H = hidden.shape
    _checks.tensor("w13", w13, (hidden.dtype,), ndim=3, device=dev)
    E, two_i = w13.shape[0], w13.shape[1]
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13: the middle dimension is gate + up rows (2 * I), got {two_i}")
    if E == 0:
        raise ValueError("w13: expected at least one expert")
    _checks.shape("w13", w13, [E, two_i, H])
    _checks.tensor("w2", w2, (hidden.dtype,), ndim=3, device=dev)
    _checks.shape("w2", w2, [E, H, two_i // 2])
    if (router_weight is None) == (router_logits is None):
        raise ValueError(
            "router_weight, router_logits: give exactly one of them (the router's [E, H] "
            "weight, or precomputed [T, E] logits)"
        )
    if router_weight is not None:
        _checks.tensor("router_weight", router_weight, _checks.FLOAT_DTYPES, ndim=2, device=dev)
        _checks.shape("router_weight", router_weight, [E, H])
    else:
        _checks.tensor("router_logits", router_logits, _checks.FLOAT_DTYPES, ndim=2, device=dev)
        _checks.shape("router_logits", router_logits, [T, E])
    if scoring not in _SCORING_CODES:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    num_groups = _checks.integer("num_groups", num_groups, 1, E + 1)
    if E % num_groups:
        raise ValueError(f"num_groups: must divide the number of experts E={E}, got {num_groups}")
    topk_groups = _checks.integer("topk_groups", topk_groups, 1, num_groups + 1)
    selectable = topk_groups * (E // num_groups)
    top_k = _checks.integer("top_k", top_k, 1)
    if top_k > selectable:
        raise ValueError(
            f"top_k: {top_k} is more than the {selectable} experts that can be chosen "
            f"(E={E}, num_groups={num_groups}, topk_groups={topk_groups})"
        )
    routed_scaling = _checks.number("routed_scaling", routed_scaling)
    if expert_bias is not None:
        _checks.tensor("expert_bias", expert_bias, _checks.FLOAT_DTYPES, ndim=1, device=dev)
        _checks.shape("expert_bias", expert_bias, [E])
    if expert_range is None:
        e0, e1 = 0, E
    else:
        if not isinstance(expert_range, (tuple, list)) or len(expert_range) != 2:
            raise TypeError(f"expert_range: expected a pair (e0, e1) or None, got {expert_range!r}")
        e0, e1 = expert_range
        e0 = _checks.integer("expert_range[0]", e0, 0, E + 1)
        e1 = _checks.integer("expert_range[1]", e1, e0, E + 1)
    return _moe_op(
        hidden,
        router_weight,
        router_logits,
        w13,
        w2,
        top_k,
        bool(renormalize),
        _SCORING_CODES[scoring],
        expert_bias,
        num_groups,
        topk_groups,
        routed_scaling,
        e0,
        e1,
        _backend.resolve(
            backend,
            dev,
            "moe",
            dtype=hidden.dtype,
            rows_per_expert=T * top_k / E,
            weight_bytes=(w13.numel() + w2.numel()) * w13.element_size(),
        ),
    )
