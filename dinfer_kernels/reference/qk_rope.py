"""q and k rotated together from a precomputed cos / sin table, optionally RMS-normalised first (the
attention's QK-norm, LLaDA2's and LLaDA-MoE's) — the spec.

q [B, T, Hq, D] and k [B, T, Hk, D] of one float dtype (fp32 / fp16 / bf16; any Hq, Hk >= 0);
positions [B, T] int64 (or int32) in [0, P); table [P, rotary_dim] fp32, rotary_dim even and <= D,
row p holding cos, then sin, of p's angles: dinfer_kernels.rope_table(theta, rotary_dim, P), i.e.
reference/rope.py's cos_sin_table(arange(P)); q_norm, k_norm [D] of q's dtype, both or neither, and
eps > 0 with them.

    q_out = rope(rms_norm(q, q_norm, eps)),  k_out = rope(rms_norm(k, k_norm, eps))

rms_norm is reference/rms_norm.py's over the head dim D (skipped without weights), rope is
reference/rope.py's at each row's position with the angles read from the table (the values
rope_reference computes, bit for bit), so this is exactly the composition the models ran before:
two rms_norm calls, then two rope calls. Outputs in q's dtype, contiguous.
"""

import torch

from .rms_norm import rms_norm_reference
from .rope import rotate


def qk_rope_reference(
    q, k, positions, table, q_norm=None, k_norm=None, eps=None, compute_dtype=torch.float32
):
    cs = table[positions.long()].to(compute_dtype)  # [B, T, rotary_dim]: cos | sin
    rd = table.shape[1]
    cos, sin = cs[..., : rd // 2], cs[..., rd // 2 :]
    outs = []
    for x, weight in ((q, q_norm), (k, k_norm)):
        if weight is not None:
            x = rms_norm_reference(x, weight, eps, compute_dtype)
        outs.append(rotate(x, cos, sin, rd, compute_dtype))
    return tuple(outs)
