"""Rotary position embedding, rotate-half (NeoX) style — the spec.

x [B, T, H, D] fp32 / fp16 / bf16; positions [B, T] int64 >= 0 (absolute positions in the
sequence, one per row: window rows sit at their own positions); theta > 0; rotary_dim even, <= D
(the first rotary_dim dims rotate, the rest pass through; LLaDA2 uses D / 2).

    inv_freq[j] = 1 / theta ** (2j / rotary_dim),  j < rotary_dim / 2      (fp32, as the releases)
    a = position * inv_freq;  cos, sin = [cos a, cos a], [sin a, sin a]
    out = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]

Math in fp32, result in x's dtype.
"""

import torch


def inv_freq(theta, rotary_dim, device=None):
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim))


def cos_sin_table(positions, theta, rotary_dim):
    """[len(positions), rotary_dim] fp32: cos, then sin, of each position's angles, with the
    reference's own math below (so the kernels that read it agree with the reference bit for bit)."""
    ang = positions.to(torch.float32)[:, None] * inv_freq(theta, rotary_dim, positions.device)
    return torch.cat([ang.cos(), ang.sin()], -1)


def rope_reference(x, positions, theta, rotary_dim=None, compute_dtype=torch.float32):
    D = x.shape[-1]
    rd = D if rotary_dim is None else rotary_dim
    ang = positions.to(compute_dtype)[..., None] * inv_freq(theta, rd, x.device).to(compute_dtype)
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, :, None, :]
    xr = x[..., :rd].to(compute_dtype)
    half = rd // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], -1)
    out = xr * cos + rotated * sin
    out_dtype = x.dtype if compute_dtype == torch.float32 else compute_dtype
    return torch.cat([out.to(out_dtype), x[..., rd:].to(out_dtype)], -1)
