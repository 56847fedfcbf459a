"""RMSNorm — the spec (LLaDA, LLaDA-MoE and LLaDA2 all use this order).

    y = cast(x * rsqrt(mean(x^2, -1) + eps), x.dtype) * weight

x [..., D] fp32 / fp16 / bf16; weight [D] of x's dtype; eps > 0. The statistic is computed in fp32,
the normalised value is rounded to x's dtype *before* the weight multiply (as the released models
do), and the result has x's dtype. Also used for per-head QK-norm (D = head_dim).
"""

import torch


def rms_norm_reference(x, weight, eps, compute_dtype=torch.float32):
    xf = x.to(compute_dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out_dtype = x.dtype if compute_dtype == torch.float32 else compute_dtype
    return y.to(out_dtype) * weight.to(out_dtype)
