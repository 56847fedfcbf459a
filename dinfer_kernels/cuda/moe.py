"""moe on a GPU through the compiled CUDA kernels (csrc/moe/moe.cu).

The workspace comes from torch's caching allocator (capture-safe) and the kernels run on the current
stream, so the call can sit inside a CUDA graph. Inputs are made contiguous and the router logits and
expert bias fp32 here (no-ops in the usual case); the kernels take E <= 512 and top_k <= 32.
"""
import torch

from .._backend import compiled


def moe(hidden, router_weight, router_logits, w13, w2, top_k, renormalize, scoring, expert_bias,
        num_groups, topk_groups, routed_scaling, e0, e1, out):
    """Writes out [T, H] (contiguous, hidden's dtype); the contract is reference/moe.py."""
    ext = compiled()
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    if T == 0 or H == 0:
        return
    if router_weight is not None:
        if router_weight.dtype not in (torch.float32, hidden.dtype):
            router_weight = router_weight.float()
        router_weight = router_weight.contiguous()
    if router_logits is not None:
        router_logits = router_logits.float().contiguous()
    if expert_bias is not None:
        expert_bias = expert_bias.float().contiguous()
    target = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
    workspace = torch.empty(ext.moe_workspace_bytes(T, E, top_k, H, two_i // 2), dtype=torch.uint8,
                            device=hidden.device)
    stream = torch.cuda.current_stream(hidden.device).cuda_stream
    with torch.cuda.device(hidden.device):   # launches go to the current device
        ext.moe(hidden.contiguous(), router_weight, router_logits, w13.contiguous(), w2.contiguous(), top_k,
                bool(renormalize), scoring, expert_bias, num_groups, topk_groups, float(routed_scaling), e0,
                e1, target, workspace=workspace, stream=stream)
    if target is not out:
        out.copy_(target)
