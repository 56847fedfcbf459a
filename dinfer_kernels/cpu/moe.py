"""moe on the host through the compiled C++ kernel (csrc/moe/moe_cpu.cpp).

Inputs are laid out as the compiled kernels take them (_moe_layout: no-ops in the usual case); the
contract is dinfer_kernels/reference/moe.py. Runs on torch's intra-op thread count.
"""

import torch

from .._backend import compiled
from .._moe_layout import compiled_layout, given_topk
from . import capsules


def moe(
    hidden,
    router_weight,
    router_logits,
    w13,
    w2,
    expert_bias,
    out,
    *,
    top_k: int,
    renormalize: bool,
    scoring: str,
    num_groups: int,
    topk_groups: int,
    routed_scaling: float,
    expert_offset: int,
    topk_ids=None,
    topk_weights=None,
    shared_w13=None,
    shared_w2=None,
    w13_scale=None,
    w2_scale=None,
    shared_w13_scale=None,
    shared_w2_scale=None,
) -> None:
    """Writes out [T, H] (contiguous, hidden's dtype)."""
    if hidden.shape[0] == 0 or hidden.shape[1] == 0:
        return
    hidden, router_weight, router_logits, w13, w2, expert_bias = compiled_layout(
        hidden, router_weight, router_logits, w13, w2, expert_bias
    )
    topk_ids, topk_weights = given_topk(topk_ids, topk_weights, expert_offset, w13.shape[0])
    hidden, router_weight, router_logits, w13, w2, expert_bias, out, topk_ids, topk_weights = capsules(
        hidden, router_weight, router_logits, w13, w2, expert_bias, out, topk_ids, topk_weights
    )
    # The shared expert and the FP8 scales only when given: each keyword costs the call a little.
    optional = dict(
        shared_w13=shared_w13,
        shared_w2=shared_w2,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        shared_w13_scale=shared_w13_scale,
        shared_w2_scale=shared_w2_scale,
    )
    given = {name: capsules(t.contiguous())[0] for name, t in optional.items() if t is not None}
    compiled().moe(
        hidden,
        router_weight,
        router_logits,
        w13,
        w2,
        top_k,
        bool(renormalize),
        scoring,
        expert_bias,
        num_groups,
        topk_groups,
        float(routed_scaling),
        expert_offset,
        out,
        topk_ids=topk_ids,
        topk_weights=topk_weights,
        num_threads=torch.get_num_threads(),
        **given,
    )
