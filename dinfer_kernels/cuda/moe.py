"""moe on a GPU through the compiled CUDA kernels (csrc/moe/moe.cu).

The workspace comes from torch's caching allocator (capture-safe) and the kernels run on the current
stream, so the call can sit inside a CUDA graph. Inputs are laid out as the compiled kernels take them
(_moe_layout: no-ops in the usual case); the kernels take E <= 512 (E_local + ceil(S / I) with a
shared expert) and top_k <= 32.
"""

import torch

from .._backend import compiled
from .._moe_layout import compiled_layout, contiguous_or_none, given_topk


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
    """Writes out [T, H] (contiguous, hidden's dtype); the contract is reference/moe.py."""
    ext = compiled()
    T, H = hidden.shape
    E_local, two_i, _ = w13.shape
    if T == 0 or H == 0:
        return
    hidden, router_weight, router_logits, w13, w2, expert_bias = compiled_layout(
        hidden, router_weight, router_logits, w13, w2, expert_bias
    )
    shared_w13, shared_w2, w13_scale, w2_scale, shared_w13_scale, shared_w2_scale = contiguous_or_none(
        shared_w13, shared_w2, w13_scale, w2_scale, shared_w13_scale, shared_w2_scale
    )
    S = 0 if shared_w13 is None else shared_w13.shape[0] // 2
    topk_ids, topk_weights = given_topk(topk_ids, topk_weights, expert_offset, E_local)
    # The router's experts (the logits' width); a given top-k has no router.
    E = (
        0
        if topk_ids is not None
        else (router_weight.shape[0] if router_weight is not None else router_logits.shape[1])
    )
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    workspace = torch.empty(
        ext.moe_workspace_bytes(T, E, E_local, top_k, H, two_i // 2, S),
        dtype=torch.uint8,
        device=hidden.device,
    )
    stream = torch.cuda.current_stream(hidden.device).cuda_stream
    with torch.cuda.device(hidden.device):  # launches go to the current device
        ext.moe(
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
            target,
            topk_ids=topk_ids,
            topk_weights=topk_weights,
            shared_w13=shared_w13,
            shared_w2=shared_w2,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            shared_w13_scale=shared_w13_scale,
            shared_w2_scale=shared_w2_scale,
            workspace=workspace,
            stream=stream,
        )
    if target is not out:
        out.copy_(target)
