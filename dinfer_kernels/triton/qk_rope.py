"""qk_rope in Triton: q and k in one launch, the QK-norm fused. Contract:
dinfer_kernels/reference/qk_rope.py.

Grid: one program per (row b * T + t, block of HEADS heads) over the Hq + Hk heads of q then k, so a
block may hold heads of both (each head loads from and stores to its own tensor). A program gathers
its row's cos / sin from the table at the row's position (no per-call table: the caller built it
once), loads each head as its two rotated halves and the dims past rotary_dim; with the norm weights,
it takes the fp32 sum of squares over the whole head dim, scales, rounds to the dtype and multiplies
by the weight as rms_norm does (rounding the result to the dtype, as the reference's rope then reads
it), then rotates in fp32 and stores. No workspace, no host sync: capturable. q and k of any strides
with a contiguous last dim; a position outside the table reads cos = sin = 0 (never out of bounds).
"""

import triton
import triton.language as tl


@triton.jit
def _qk_rope_kernel(
    q,
    sqb,
    sqt,
    sqh,
    k,
    skb,
    skt,
    skh,
    q_out,
    k_out,
    positions,
    spb,
    spt,
    table,
    P,
    q_norm,
    k_norm,
    eps,
    T,
    HQ,
    HK,
    D,
    HALF,
    NORM: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr,
):
    row = tl.program_id(0)  # b * T + t
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # q's heads, then k's
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HK)
    hq = h.to(tl.int64)
    hk = tl.where(is_k, h - HQ, 0).to(tl.int64)
    # the row's angles: its position's table row, cos then sin
    pos = tl.load(positions + b * spb + t * spt).to(tl.int64)
    inside = (pos >= 0) & (pos < P)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    angles = table + tl.where(inside, pos, 0) * 2 * HALF
    jc = j < tl.where(inside, HALF, 0)  # no angles outside the table
    c = tl.load(angles + j, mask=jc, other=0.0)
    s = tl.load(angles + HALF + j, mask=jc, other=0.0)
    # each head's row in its own tensor (outputs contiguous: [B, T, H, D])
    qx = q + b * sqb + t * sqt + hq[:, None] * sqh
    kx = k + b * skb + t * skt + hk[:, None] * skh
    qo = q_out + ((b * T + t) * HQ + hq[:, None]) * D
    ko = k_out + ((b * T + t) * HK + hk[:, None]) * D
    mq = is_q[:, None] & jm[None, :]
    mk = is_k[:, None] & jm[None, :]
    x1 = tl.where(is_q[:, None], tl.load(qx + j[None, :], mask=mq), tl.load(kx + j[None, :], mask=mk))
    x2 = tl.where(
        is_q[:, None], tl.load(qx + HALF + j[None, :], mask=mq), tl.load(kx + HALF + j[None, :], mask=mk)
    )
    d = 2 * HALF + tl.arange(0, BLOCK_REST)  # the dims past rotary_dim
    dm = d < D
    rq = is_q[:, None] & dm[None, :]
    rk = is_k[:, None] & dm[None, :]
    xr = tl.where(is_q[:, None], tl.load(qx + d[None, :], mask=rq), tl.load(kx + d[None, :], mask=rk))
    dtype = q_out.dtype.element_ty
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM:  # rms_norm over the whole head dim, rounded to the dtype before and after the weight
        xf = xr.to(tl.float32)
        ss = tl.sum(tl.where(mq | mk, x1 * x1 + x2 * x2, 0.0), axis=1)
        ss += tl.sum(tl.where(rq | rk, xf * xf, 0.0), axis=1)
        inv = (1.0 / tl.sqrt(ss / D + eps))[:, None]
        g1 = tl.where(
            is_q[:, None], tl.load(q_norm + j, mask=jm)[None, :], tl.load(k_norm + j, mask=jm)[None, :]
        )
        g2 = tl.where(
            is_q[:, None],
            tl.load(q_norm + HALF + j, mask=jm)[None, :],
            tl.load(k_norm + HALF + j, mask=jm)[None, :],
        )
        gr = tl.where(
            is_q[:, None], tl.load(q_norm + d, mask=dm)[None, :], tl.load(k_norm + d, mask=dm)[None, :]
        )
        x1 = ((x1 * inv).to(dtype).to(tl.float32) * g1.to(tl.float32)).to(dtype).to(tl.float32)
        x2 = ((x2 * inv).to(dtype).to(tl.float32) * g2.to(tl.float32)).to(dtype).to(tl.float32)
        xr = ((xf * inv).to(dtype).to(tl.float32) * gr.to(tl.float32)).to(dtype)
    o1 = (x1 * c[None, :] - x2 * s[None, :]).to(dtype)
    o2 = (x2 * c[None, :] + x1 * s[None, :]).to(dtype)
    tl.store(qo + j[None, :], o1, mask=mq)
    tl.store(ko + j[None, :], o1, mask=mk)
    tl.store(qo + HALF + j[None, :], o2, mask=mq)
    tl.store(ko + HALF + j[None, :], o2, mask=mk)
    tl.store(qo + d[None, :], xr, mask=rq)
    tl.store(ko + d[None, :], xr, mask=rk)


def qk_rope(q, k, positions, table, q_norm, k_norm, q_out, k_out, *, eps: float) -> None:
    """Writes q_out [B, T, Hq, D] and k_out [B, T, Hk, D] (contiguous, q's dtype), on any device
    Triton runs on."""
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    if B * T == 0 or HQ + HK == 0 or D == 0:
        return
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k))
    if HQ == 0:  # an empty tensor may have no address: the other one stands in (never read)
        q, q_out = k, k_out
    if HK == 0:
        k, k_out = q, q_out
    P, rd = table.shape
    half, rest = rd // 2, D - rd
    heads = min(triton.next_power_of_2(HQ + HK), 16)
    norm = q_norm is not None
    grid = (B * T, triton.cdiv(HQ + HK, heads))
    _qk_rope_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        q_out,
        k_out,
        positions,
        positions.stride(0),
        positions.stride(1),
        table,
        P,
        q_norm if norm else q_out,  # never read without NORM
        k_norm if norm else k_out,
        float(eps),
        T,
        HQ,
        HK,
        D,
        half,
        NORM=norm,
        HEADS=heads,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
    )
