"""rope in Triton. Contract: dinfer_kernels/reference/rope.py.

The angles of the call's rows come from torch with the reference's own fp32 formula (its
cos_sin_table of the call's positions: a few small launches, no host sync, bit-identical to the
reference's values); one Triton launch then rotates every head of every row, [B*T, H] programs' worth of work in
blocks of HEADS heads, and copies the dims past rotary_dim. Capturable; x of any strides with a
contiguous last dim.
"""

import triton
import triton.language as tl

from ..reference.rope import cos_sin_table


@triton.jit
def _rope_kernel(
    x,
    sxb,
    sxt,
    sxh,
    out,
    sob,
    sot,
    soh,
    table,
    T,
    H,
    D,
    HALF,
    HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # b * T + t
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    b = row // T
    t = row % T
    hm = h < H
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    angles = table + row.to(tl.int64) * 2 * HALF  # this row's [cos | sin]
    c = tl.load(angles + j, mask=jm, other=0.0)
    s = tl.load(angles + HALF + j, mask=jm, other=0.0)
    xb = x + b.to(tl.int64) * sxb + t.to(tl.int64) * sxt + h.to(tl.int64)[:, None] * sxh
    ob = out + b.to(tl.int64) * sob + t.to(tl.int64) * sot + h.to(tl.int64)[:, None] * soh
    m = hm[:, None] & jm[None, :]
    x1 = tl.load(xb + j[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + HALF + j[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(ob + j[None, :], (x1 * c[None, :] - x2 * s[None, :]).to(out.dtype.element_ty), mask=m)
    tl.store(ob + HALF + j[None, :], (x2 * c[None, :] + x1 * s[None, :]).to(out.dtype.element_ty), mask=m)
    if D > 2 * HALF:  # the dims past rotary_dim pass through
        d = 2 * HALF + tl.arange(0, BLOCK_D)
        pm = hm[:, None] & (d < D)[None, :]
        tl.store(ob + d[None, :], tl.load(xb + d[None, :], mask=pm, other=0.0), mask=pm)


def rope(x, positions, out, *, theta: float, rotary_dim: int) -> None:
    """Writes out [B, T, H, D] (x's shape and dtype, any strides): x rotated at positions [B, T]."""
    if x.numel() == 0:
        return
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    B, T, H, D = x.shape
    half = rotary_dim // 2
    table = cos_sin_table(positions.reshape(-1), theta, rotary_dim)
    heads = min(triton.next_power_of_2(H), 16)
    rest = D - rotary_dim
    grid = (B * T, triton.cdiv(H, heads))
    _rope_kernel[grid](
        x,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        table,
        T,
        H,
        D,
        half,
        HEADS=heads,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_D=triton.next_power_of_2(max(rest, 1)),
    )
