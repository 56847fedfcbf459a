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
from ..fp8 import FP8_DTYPE, check_scale
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
    shared_w13: Optional[torch.Tensor],
    shared_w2: Optional[torch.Tensor],
    w13_scale: Optional[torch.Tensor],
    w2_scale: Optional[torch.Tensor],
    shared_w13_scale: Optional[torch.Tensor],
    shared_w2_scale: Optional[torch.Tensor],
    backend: str,
) -> torch.Tensor:
    name = SCORINGS[scoring]
    given = dict(
        shared_w13=shared_w13,
        shared_w2=shared_w2,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        shared_w13_scale=shared_w13_scale,
        shared_w2_scale=shared_w2_scale,
    )
    extra = {name: t for name, t in given.items() if t is not None}  # backends default them to None
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
            **extra,
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
        **extra,
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
    shared_w13,
    shared_w2,
    w13_scale,
    w2_scale,
    shared_w13_scale,
    shared_w2_scale,
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
    shared_w13: Optional[torch.Tensor] = None,
    shared_w2: Optional[torch.Tensor] = None,
    w13_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    shared_w13_scale: Optional[torch.Tensor] = None,
    shared_w2_scale: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """[T, H] output of the routed experts (plus a shared expert's), in hidden's dtype; see the
    reference docstring.

    LLaDA-MoE: moe(h, router_weight, w13, w2, 8) (softmax, no renormalisation).
    LLaDA2:    moe(h, router_weight, w13, w2, 8, scoring="sigmoid", expert_bias=b, num_groups=8,
                   topk_groups=4, renormalize=True, routed_scaling=2.5).
    Expert parallelism: w13 / w2 hold experts [expert_offset, expert_offset + E_local) only; the
    router scores all E; the pairs routed elsewhere contribute nothing.
    The routing is exactly one of router_weight [E, H], router_logits [T, E], or a given top-k
    (topk_ids [T, top_k] int32 / int64 global expert ids, topk_weights [T, top_k] float; the router's
    options then keep their defaults).
    Shared expert (LLaDA2): shared_w13 [2S, H], shared_w2 [H, S], in the same call (every token, weight 1).
    FP8 experts: w13 / w2 (and the shared pair) float8_e4m3fn with their fp32 128 x 128 block scales
    (dinfer_kernels.fp8_block_quantize makes them; layout in dinfer_kernels/fp8.py).
    """
    _checks.tensor("hidden", hidden, _checks.FLOAT_DTYPES, ndim=2)
    dev = hidden.device
    T, H = hidden.shape
    fp8 = w13.dtype == FP8_DTYPE if isinstance(w13, torch.Tensor) else False
    weight_dtype = FP8_DTYPE if fp8 else hidden.dtype
    _checks.tensor("w13", w13, (weight_dtype,), ndim=3, device=dev)
    E_local, two_i = w13.shape[0], w13.shape[1]
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13: the middle dimension is gate + up rows (2 * I), got {two_i}")
    _checks.shape("w13", w13, [E_local, two_i, H])
    _checks.tensor("w2", w2, (weight_dtype,), ndim=3, device=dev)
    _checks.shape("w2", w2, [E_local, H, two_i // 2])
    if (shared_w13 is None) != (shared_w2 is None):
        missing = "shared_w13" if shared_w13 is None else "shared_w2"
        raise ValueError(f"{missing}: shared_w13 and shared_w2 come together (the shared expert)")
    if shared_w13 is not None:
        _checks.tensor("shared_w13", shared_w13, (weight_dtype,), ndim=2, device=dev)
        two_s = shared_w13.shape[0]
        if two_s % 2 or two_s == 0:
            raise ValueError(f"shared_w13: the first dimension is gate + up rows (2 * S), got {two_s}")
        _checks.shape("shared_w13", shared_w13, [two_s, H])
        _checks.tensor("shared_w2", shared_w2, (weight_dtype,), ndim=2, device=dev)
        _checks.shape("shared_w2", shared_w2, [H, two_s // 2])
    scales = dict(
        w13_scale=(w13_scale, w13, 2),
        w2_scale=(w2_scale, w2, 1),
        shared_w13_scale=(shared_w13_scale, shared_w13, 2),
        shared_w2_scale=(shared_w2_scale, shared_w2, 1),
    )
    for name, (scale, weight, halves) in scales.items():
        if weight is None or not fp8:
            if scale is not None:
                why = "there is no shared expert" if weight is None else "the weights are not float8_e4m3fn"
                raise ValueError(f"{name}: block scales go with FP8 weights only ({why})")
        elif scale is None:
            raise ValueError(f"{name}: FP8 weights need their fp32 block scales")
        else:
            check_scale(name, scale, weight, halves)
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
    if E_local == 0:  # no local expert: nothing contributes but a shared expert (the reference runs it)
        if shared_w13 is None:
            return torch.zeros_like(hidden, memory_format=torch.contiguous_format)
        backend = "torch"
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
        shared_w13,
        shared_w2,
        w13_scale,
        w2_scale,
        shared_w13_scale,
        shared_w2_scale,
        _backend.resolve(
            backend,
            dev,
            "moe",
            dtype=hidden.dtype,
            rows_per_expert=rows_per_expert,
            weight_bytes=(w13.numel() + w2.numel()) * w13.element_size(),
            weight_dtype=w13.dtype,
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
