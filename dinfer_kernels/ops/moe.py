"""dinfer_kernels.moe, the torch.library op `dinfer::moe` (router + top-k + experts + weighted
combine), on all experts or on a slice of local experts (expert parallelism), from a router or from a
given top-k; and dinfer_kernels.moe_route, the router alone. Contract: dinfer_kernels/reference/moe.py.

Backends: "cuda" (csrc/moe, when the extension was built with it), "triton"
(dinfer_kernels/triton/moe.py), "cpu" (csrc/moe/moe_cpu.cpp: host arrays) and "torch" (the
reference: rows grouped by expert once, a loop over experts). The cuda and triton backends keep
everything on the device with grids fixed by the shapes, so a call can sit in a CUDA graph; the torch
reference switches to its static-shape path under capture.
"""

from typing import Optional, Tuple

import torch

from .. import _backend, _checks, _dispatch
from ..reference.moe import SCORINGS, moe_reference, route

_SCORING_CODES = {name: i for i, name in enumerate(SCORINGS)}
_INT_DTYPES = (torch.int32, torch.int64)


@_dispatch.op("moe")
def _moe_op(
    hidden: torch.Tensor,
    router_weight: Optional[torch.Tensor],
    router_logits: Optional[torch.Tensor],
    topk_ids: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: int,
    expert_bias: Optional[torch.Tensor],
    num_groups: int,
    topk_groups: int,
    routed_scaling: float,
    expert_offset: int,
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
            expert_offset,
            router_logits=router_logits,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
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
        expert_offset=expert_offset,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
    )
    return out


@_moe_op.register_fake
def _(
    hidden,
    router_weight,
    router_logits,
    topk_ids,
    topk_weights,
    w13,
    w2,
    top_k,
    renormalize,
    scoring,
    expert_bias,
    num_groups,
    topk_groups,
    routed_scaling,
    expert_offset,
    backend,
):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


def _router_checks(
    hidden, router_weight, router_logits, top_k, scoring, expert_bias, num_groups, topk_groups
):
    """The router's arguments checked; returns (E, top_k, num_groups, topk_groups)."""
    dev = hidden.device
    T, H = hidden.shape
    if (router_weight is None) == (router_logits is None):
        raise ValueError(
            "router_weight, router_logits: give exactly one of them (the router's [E, H] "
            "weight, or precomputed [T, E] logits)"
        )
    if router_weight is not None:
        _checks.tensor("router_weight", router_weight, _checks.FLOAT_DTYPES, ndim=2, device=dev)
        E = router_weight.shape[0]
        _checks.shape("router_weight", router_weight, [E, H])
    else:
        _checks.tensor("router_logits", router_logits, _checks.FLOAT_DTYPES, ndim=2, device=dev)
        E = router_logits.shape[1]
        _checks.shape("router_logits", router_logits, [T, E])
    if E == 0:
        raise ValueError(
            f"{'router_weight' if router_logits is None else 'router_logits'}: expected at least one expert"
        )
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
    if expert_bias is not None:
        _checks.tensor("expert_bias", expert_bias, _checks.FLOAT_DTYPES, ndim=1, device=dev)
        _checks.shape("expert_bias", expert_bias, [E])
    return E, top_k, num_groups, topk_groups


def moe(
    hidden: torch.Tensor,
    router_weight: Optional[torch.Tensor],
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    *,
    router_logits: Optional[torch.Tensor] = None,
    topk_ids: Optional[torch.Tensor] = None,
    topk_weights: Optional[torch.Tensor] = None,
    renormalize: bool = False,
    scoring: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling: float = 1.0,
    expert_offset: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """[T, H] output of the routed experts, in hidden's dtype; see the reference docstring.

    LLaDA-MoE: moe(h, router_weight, w13, w2, 8) (softmax, no renormalisation).
    LLaDA2:    moe(h, router_weight, w13, w2, 8, scoring="sigmoid", expert_bias=b, num_groups=8,
                   topk_groups=4, renormalize=True, routed_scaling=2.5).
    Expert parallelism: w13 / w2 hold experts [expert_offset, expert_offset + E_local) only; the
    router scores all E; the pairs routed elsewhere contribute nothing.
    The routing is exactly one of router_weight [E, H], router_logits [T, E], or a given top-k
    (topk_ids [T, top_k] int32 / int64 global expert ids, topk_weights [T, top_k] float; the router's
    options then keep their defaults).
    """
    _checks.tensor("hidden", hidden, _checks.FLOAT_DTYPES, ndim=2)
    dev = hidden.device
    T, H = hidden.shape
    _checks.tensor("w13", w13, (hidden.dtype,), ndim=3, device=dev)
    E_local, two_i = w13.shape[0], w13.shape[1]
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13: the middle dimension is gate + up rows (2 * I), got {two_i}")
    _checks.shape("w13", w13, [E_local, two_i, H])
    _checks.tensor("w2", w2, (hidden.dtype,), ndim=3, device=dev)
    _checks.shape("w2", w2, [E_local, H, two_i // 2])
    routed_scaling = _checks.number("routed_scaling", routed_scaling)
    if topk_ids is not None or topk_weights is not None:
        if router_weight is not None or router_logits is not None:
            raise ValueError(
                "router_weight, router_logits, topk_ids: give a router (router_weight or router_logits) "
                "or a given top-k (topk_ids and topk_weights), not both"
            )
        if topk_ids is None or topk_weights is None:
            missing = "topk_ids" if topk_ids is None else "topk_weights"
            raise ValueError(f"{missing}: topk_ids and topk_weights come together")
        _checks.tensor("topk_ids", topk_ids, _INT_DTYPES, ndim=2, device=dev)
        _checks.tensor("topk_weights", topk_weights, _checks.FLOAT_DTYPES, ndim=2, device=dev)
        k = topk_ids.shape[1]
        _checks.shape("topk_ids", topk_ids, [T, k])
        _checks.shape("topk_weights", topk_weights, [T, k])
        top_k = _checks.integer("top_k", top_k, 1)
        if top_k != k:
            raise ValueError(f"top_k: {top_k} differs from the {k} columns of topk_ids")
        router_options = dict(
            renormalize=bool(renormalize) is False,
            scoring=scoring == "softmax",
            expert_bias=expert_bias is None,
            num_groups=num_groups == 1,
            topk_groups=topk_groups == 1,
            routed_scaling=routed_scaling == 1.0,
        )
        for name, default in router_options.items():
            if not default:
                raise ValueError(f"{name}: a router option; it does not apply to a given top-k (topk_ids)")
        expert_offset = _checks.integer("expert_offset", expert_offset, 0)
        rows_per_expert = T * top_k / max(E_local, 1)
    else:
        E, top_k, num_groups, topk_groups = _router_checks(
            hidden, router_weight, router_logits, top_k, scoring, expert_bias, num_groups, topk_groups
        )
        if E_local > E:
            raise ValueError(f"w13: {E_local} local experts are more than the router's E={E}")
        expert_offset = _checks.integer("expert_offset", expert_offset, 0, E - E_local + 1)
        rows_per_expert = T * top_k / E
    if E_local == 0:  # no local expert: nothing contributes
        return torch.zeros_like(hidden, memory_format=torch.contiguous_format)
    return _moe_op(
        hidden,
        router_weight,
        router_logits,
        topk_ids,
        topk_weights,
        w13,
        w2,
        top_k,
        bool(renormalize),
        _SCORING_CODES[scoring],
        expert_bias,
        num_groups,
        topk_groups,
        routed_scaling,
        expert_offset,
        _backend.resolve(
            backend,
            dev,
            "moe",
            dtype=hidden.dtype,
            rows_per_expert=rows_per_expert,
            weight_bytes=(w13.numel() + w2.numel()) * w13.element_size(),
        ),
    )


def moe_route(
    hidden: torch.Tensor,
    router_weight: Optional[torch.Tensor],
    top_k: int,
    *,
    router_logits: Optional[torch.Tensor] = None,
    renormalize: bool = False,
    scoring: str = "softmax",
    expert_bias: Optional[torch.Tensor] = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    routed_scaling: float = 1.0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The router alone: (weights [T, top_k] fp32, experts [T, top_k] int64), slot j the j-th best
    expert, as moe's router chooses them (reference.moe.route, in torch: one [T, H] x [H, E] GEMM and
    a top-k). What the all-to-all path sends with each row before moe(topk_ids=, topk_weights=)."""
    _checks.tensor("hidden", hidden, _checks.FLOAT_DTYPES, ndim=2)
    routed_scaling = _checks.number("routed_scaling", routed_scaling)
    _, top_k, num_groups, topk_groups = _router_checks(
        hidden, router_weight, router_logits, top_k, scoring, expert_bias, num_groups, topk_groups
    )
    return route(
        hidden,
        router_weight,
        top_k,
        bool(renormalize),
        expert_bias,
        router_logits=router_logits,
        scoring=scoring,
        num_groups=num_groups,
        topk_groups=topk_groups,
        routed_scaling=routed_scaling,
    )
