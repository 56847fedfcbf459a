"""Rotary position embedding, rotate-half (NeoX) style — the spec.

x [B, T, H, D] fp32 / fp16 / bf16; positions [B, T] int64 >= 0 (absolute positions in the
sequence, one per row: window rows sit at their own positions); theta > 0; rotary_dim even, <= D
(the first rotary_dim dims rotate, the rest pass through; LLaDA2 uses D / 2).

    inv_freq[j] = 1 / theta ** (2j / rotary_dim),  j < rotary_dim / 2      (fp32, as the releases)
    a = position * inv_freq;  cos, sin = [cos a, cos a], [sin a, sin a]
    out = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]

Math in fp32, result in x's dtype.

The angles as a table: cos_sin_table(positions) holds, per position, cos a then sin a in fp32,
computed with exactly the formula above, so a kernel that gathers a position's row computes the same
values as this reference, bit for bit. dinfer_kernels.rope_table(theta, rotary_dim, P) is
cos_sin_table(arange(P)), the table of positions [0, P) a model builds once and dinfer_kernels.qk_rope
reads (reference/qk_rope.py).
"""

import torch


def inv_freq(theta, rotary_dim, device=None):
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim))


def cos_sin_table(positions, theta, rotary_dim):
    """[len(positions), rotary_dim] fp32: cos, then sin, of each position's angles, with the
    reference's own math below (so the kernels that read it agree with the reference bit for bit)."""
    ang = positions.to(torch.float32)[:, None] * inv_freq(theta, rotary_dim, positions.device)
    return torch.cat([ang.cos(), ang.sin()], -1)


def rotate(x, cos, sin, rotary_dim, compute_dtype=torch.float32):
    """x [B, T, H, D] rotated by its rows' cos, sin [B, T, rotary_dim / 2] (of the angles a above):
    the formula above in compute_dtype, the dims past rotary_dim passed through."""
    cos = torch.cat([cos, cos], -1)[:, :, None, :]
    sin = torch.cat([sin, sin], -1)[:, :, None, :]
    xr = x[..., :rotary_dim].to(compute_dtype)
    half = rotary_dim // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    out = xr * cos + rotated * sin
    out_dtype = x.dtype if compute_dtype == torch.float32 else compute_dtype
    return torch.cat([out.to(out_dtype), x[..., rotary_dim:].to(out_dtype)], -1)


def rope_reference(x, positions, theta, rotary_dim=None, compute_dtype=torch.float32):
    D = x.shape[-1]
    rd = D if rotary_dim is None else rotary_dim
    ang = positions.to(compute_dtype)[..., None] * inv_freq(theta, rd, x.device).to(compute_dtype)
    return rotate(x, ang.cos(), ang.sin(), rd, compute_dtype)
