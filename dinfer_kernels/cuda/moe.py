"""moe on a GPU through the compiled CUDA kernels (csrc/moe/moe.cu).

The workspace comes from torch's caching allocator (capture-safe) and the kernels run on the current
stream, so the call can sit inside a CUDA graph. Inputs are laid out as the compiled kernels take them
(_moe_layout: no-ops in the usual case); the kernels take E <= 512 and top_k <= 32.
"""

import torch

from .._backend import compiled
from .._moe_layout import compiled_layout


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
    e0: int,
    e1: int,
) -> None:
    """Writes out [T, H] (contiguous, hidden's dtype); the contract is reference/moe.py."""
    ext = compiled()
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    if T == 0 or H == 0:
        return
    hidden, router_weight, router_logits, w13, w2, expert_bias = compiled_layout(
        hidden, router_weight, router_logits, w13, w2, expert_bias
    )
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    workspace = torch.empty(
        ext.moe_workspace_bytes(T, E, top_k, H, two_i // 2), dtype=torch.uint8, device=hidden.device
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
            e0,
            e1,
            target,
            workspace=workspace,
            stream=stream,
        )
    if target is not out:
        out.copy_(target)
