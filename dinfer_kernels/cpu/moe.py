"""moe on the host through the compiled C++ kernel (csrc/moe/moe_cpu.cpp).

Inputs are made contiguous and the router logits and expert bias fp32 here (no-ops in the usual
case); the contract is dinfer_kernels/reference/moe.py. Runs on torch's intra-op thread count.
"""
import torch

from .._backend import compiled
from . import capsules


def moe(hidden, router_weight, router_logits, w13, w2, top_k, renormalize, scoring, expert_bias,
        num_groups, topk_groups, routed_scaling, e0, e1, out):
    """Writes out [T, H] (contiguous, hidden's dtype)."""
    if hidden.shape[0] == 0 or hidden.shape[1] == 0:
        return
    if router_weight is not None:
        if router_weight.dtype not in (torch.float32, hidden.dtype):
            router_weight = router_weight.float()
        router_weight = router_weight.contiguous()
    if router_logits is not None:
        router_logits = router_logits.float().contiguous()
    if expert_bias is not None:
        expert_bias = expert_bias.float().contiguous()
    arrays = capsules(hidden.contiguous(), router_weight, router_logits, w13.contiguous(), w2.contiguous())
    compiled().moe(*arrays, top_k, bool(renormalize), scoring, *capsules(expert_bias), num_groups, topk_groups,
                   float(routed_scaling), e0, e1, *capsules(out), num_threads=torch.get_num_threads())
