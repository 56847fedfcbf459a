"""The MoE arrays as the compiled kernels (CUDA and host) take them."""

import torch


def compiled_layout(hidden, router_weight, router_logits, w13, w2, expert_bias):
    """The arrays as the compiled kernels take them (no-ops in the usual case): contiguous, the router
    weight fp32 or hidden's dtype, the router logits and expert bias fp32."""
    if router_weight is not None:
        if router_weight.dtype not in (torch.float32, hidden.dtype):
            router_weight = router_weight.float()
        router_weight = router_weight.contiguous()
    if router_logits is not None:
        router_logits = router_logits.float().contiguous()
    if expert_bias is not None:
        expert_bias = expert_bias.float().contiguous()
    return hidden.contiguous(), router_weight, router_logits, w13.contiguous(), w2.contiguous(), expert_bias


def contiguous_or_none(*tensors):
    """The optional arrays (the shared expert's weights, the FP8 block scales) contiguous; None stays
    None."""
    return [None if t is None else t.contiguous() for t in tensors]


def given_topk(topk_ids, topk_weights, expert_offset, local_experts):
    """A given top-k as the kernels take it: int32 ids (-1 for every id outside the local slice, so
    that an int64 id never wraps into it), fp32 weights, contiguous; (None, None) when not given."""
    if topk_ids is None:
        return None, None
    inside = (topk_ids >= expert_offset) & (topk_ids < expert_offset + local_experts)
    ids = torch.where(inside, topk_ids, -1).to(torch.int32).contiguous()
    return ids, topk_weights.float().contiguous()
