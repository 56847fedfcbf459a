"""Soft embedding in Triton. Contract: dinfer_kernels/reference/soft_embedding.py.

    out[i] = E[tokens[i]] + weight[i] * softmax(z_i / tau) @ E   (masked live rows; E[tokens[i]] else)

The soft part is a GEMM over the vocabulary, P [M, V] @ E [V, d], with P computed on the fly:

1. `_stats_kernel`, grid (M, S1): per vocabulary chunk, the max and sum of exp(y - max) of the row's
   y = z * (1 / tau) (chunks as in decode, so a few rows still fill the GPU). Unmasked rows skip the
   pass and keep max = -inf, which marks them (like dead rows) as having no soft part.
2. `_gemm_kernel`, grid (M tiles, d tiles, S2): the prologue merges the S1 partials into each row's
   max and 1 / sum; then, per BLOCK_V slice of its vocabulary range, P = exp(y - max) / sum and
   acc += P @ E_slice in fp32. S2 splits the vocabulary (split-K) so that the few (M, d) tiles of a
   decode window still give ~2 programs per SM: the GEMM streams all of E, it is bandwidth-bound.
   With S2 == 1 its epilogue writes out; otherwise it writes its fp32 partial to a workspace and
3. `_reduce_kernel`, grid (M tiles, d tiles), adds the S2 partials in a fixed order (deterministic)
   and runs the same epilogue.

fp32 math as the contract: with a 16-bit E, P is split into hi + lo parts in E's dtype and both go
through the tensor cores (an fp32-accurate P at twice the MMA work); fp16 P is pre-scaled by 2**15
so that small probabilities stay normal numbers. An fp32 E uses IEEE fp32 dots.
"""

import torch
import triton
import triton.language as tl

from .decode import _merge_lanes, _online_softmax, _sanitise, _split

STATS_BLOCK_V = 2048
# ~2 GEMM programs per SM of an H200 (132 SMs); a constant, so results do not depend on the device.
GEMM_TARGET_PROGRAMS = 2 * 132
# fp16 has a narrow exponent range: P is scaled up by this (and the result down) so that the lo part
# of small probabilities stays a normal number.
P_SCALE_FP16 = 32768.0
# A vocabulary split streams at least this many rows of E (amortises the prologue and workspace).
MIN_SPLIT_ROWS = 1024


@triton.jit(do_not_specialize=["mask_id"])
def _stats_kernel(logits, stride_l, tokens, ws, M, V, S, CHUNK, mask_id, inv_tau, BLOCK_V: tl.constexpr):
    n = tl.program_id(0)
    s = tl.program_id(1)
    lo = s * CHUNK
    hi = tl.where(tl.load(tokens + n) == mask_id, tl.minimum(lo + CHUNK, V), lo)
    row = logits + n.to(tl.int64) * stride_l
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_V], tl.float32)
    for start in range(lo, hi, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        z = tl.load(row + v, mask=v < hi, other=float("-inf")).to(tl.float32)
        m, total = _online_softmax(m, total, _sanitise(z) * inv_tau)
    m, total = _merge_lanes(m, total)
    tl.store(ws + n * S + s, m)
    tl.store(ws + M * S + n * S + s, total)


@triton.jit
def _row_stats(ws, rows, live, M, S1, BLOCK_S: tl.constexpr):
    """(max, 1 / sum, active) per row from the stats partials; 1 / sum = 0 where not active."""
    sp = tl.arange(0, BLOCK_S)
    at = rows[:, None] * S1 + sp[None, :]
    ok = live[:, None] & (sp[None, :] < S1)
    part_m = tl.load(ws + at, mask=ok, other=float("-inf"))
    part_s = tl.load(ws + M * S1 + at, mask=ok, other=0.0)
    m = tl.max(part_m, 1)
    active = m > float("-inf")
    m = tl.where(active, m, 0.0)
    total = tl.sum(part_s * tl.exp(part_m - m[:, None]), 1)
    return m, tl.where(active, 1.0 / tl.where(active, total, 1.0), 0.0), active


@triton.jit
def _epilogue(
    emb,
    stride_ev,
    stride_ed,
    tokens,
    weight,
    out,
    stride_om,
    stride_od,
    V,
    rows,
    cols,
    live,
    cmask,
    active,
    soft,
):
    """out = E[tokens] + weight[row] * soft on active rows, E[tokens] elsewhere; zeros for a token outside
    [0, V) (never the mask token, so never active): unchecked values must not index past E."""
    ok = live[:, None] & cmask[None, :]
    tok = tl.load(tokens + rows, mask=live, other=0)
    tok_ok = (tok >= 0) & (tok < V)
    e_tok = tl.load(
        emb + tok[:, None] * stride_ev + cols[None, :] * stride_ed, mask=ok & tok_ok[:, None], other=0.0
    )
    w = tl.load(weight + rows, mask=live, other=0.0)
    res = e_tok.to(tl.float32) + tl.where(active[:, None], w[:, None] * soft, 0.0)
    out_ptr = out + rows[:, None] * stride_om + cols[None, :] * stride_od
    tl.store(out_ptr, res.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _gemm_kernel(
    logits,
    stride_l,
    emb,
    stride_ev,
    stride_ed,
    tokens,
    weight,
    ws,
    part,
    out,
    stride_om,
    stride_od,
    M,
    V,
    D,
    S1,
    CHUNK,
    inv_tau,
    P_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = rows < M
    cmask = cols < D
    m, inv_total, active = _row_stats(ws, rows, live, M, S1, BLOCK_S)
    inv_total = inv_total * P_SCALE

    lo = tl.program_id(2) * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    row_ptr = logits + rows.to(tl.int64)[:, None] * stride_l
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for v0 in range(lo, hi, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        vmask = v < hi
        # Inactive rows load nothing and get P = 0 (their inv_total is 0).
        z = tl.load(row_ptr + v[None, :], mask=active[:, None] & vmask[None, :], other=float("-inf"))
        p = tl.exp(_sanitise(z.to(tl.float32)) * inv_tau - m[:, None]) * inv_total[:, None]
        e = tl.load(
            emb + v.to(tl.int64)[:, None] * stride_ev + cols[None, :] * stride_ed,
            mask=vmask[:, None] & cmask[None, :],
            other=0.0,
        )
        if emb.dtype.element_ty == tl.float32:
            acc = tl.dot(p, e, acc, input_precision="ieee")
        else:
            p_hi = p.to(e.dtype)
            acc = tl.dot(p_hi, e, acc)
            acc = tl.dot((p - p_hi.to(tl.float32)).to(e.dtype), e, acc)
    acc = acc * (1.0 / P_SCALE)

    if SPLIT:
        at = tl.program_id(2) * M * D + rows[:, None] * D + cols[None, :]
        tl.store(part + at, acc, mask=live[:, None] & cmask[None, :])
    else:
        _epilogue(
            emb,
            stride_ev,
            stride_ed,
            tokens,
            weight,
            out,
            stride_om,
            stride_od,
            V,
            rows,
            cols,
            live,
            cmask,
            active,
            acc,
        )


@triton.jit
def _reduce_kernel(
    emb,
    stride_ev,
    stride_ed,
    tokens,
    weight,
    ws,
    part,
    out,
    stride_om,
    stride_od,
    M,
    V,
    D,
    S1,
    S2,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = rows < M
    cmask = cols < D
    at = rows[:, None] * D + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(S2):
        acc += tl.load(part + s * M * D + at, mask=live[:, None] & cmask[None, :], other=0.0)
    _, _, active = _row_stats(ws, rows, live, M, S1, BLOCK_S)
    _epilogue(
        emb,
        stride_ev,
        stride_ed,
        tokens,
        weight,
        out,
        stride_om,
        stride_od,
        V,
        rows,
        cols,
        live,
        cmask,
        active,
        acc,
    )


def soft_embedding(logits, embedding, tokens, weight, out, *, mask_id: int, tau: float) -> None:
    M, V = logits.shape
    D = embedding.shape[1]
    if M == 0 or D == 0:
        return
    dev = logits.device
    inv_tau = 1.0 / float(tau)

    stats_block = min(STATS_BLOCK_V, max(16, triton.next_power_of_2(V)))
    S1, chunk1 = _split(M, V, stats_block)
    ws = torch.empty(2 * M * S1, dtype=torch.float32, device=dev)
    _stats_kernel[(M, S1)](
        logits,
        logits.stride(0),
        tokens,
        ws,
        M,
        V,
        S1,
        chunk1,
        mask_id,
        inv_tau,
        BLOCK_V=stats_block,
        num_warps=max(1, stats_block // 256),
    )

    block_m = min(64, max(16, triton.next_power_of_2(M)))
    block_d = min(128, max(16, triton.next_power_of_2(D)))
    block_v = min(32, max(16, triton.next_power_of_2(V)))
    tiles = (triton.cdiv(M, block_m), triton.cdiv(D, block_d))
    S2 = max(1, min(triton.cdiv(GEMM_TARGET_PROGRAMS, tiles[0] * tiles[1]), triton.cdiv(V, MIN_SPLIT_ROWS)))
    chunk2 = triton.cdiv(triton.cdiv(V, S2), block_v) * block_v
    S2 = triton.cdiv(V, chunk2)
    part = torch.empty((S2, M, D) if S2 > 1 else (0,), dtype=torch.float32, device=dev)
    block_s = triton.next_power_of_2(S1)
    e_strides = (embedding.stride(0), embedding.stride(1))
    o_strides = (out.stride(0), out.stride(1))
    p_scale = P_SCALE_FP16 if embedding.dtype == torch.float16 else 1.0
    _gemm_kernel[tiles + (S2,)](
        logits,
        logits.stride(0),
        embedding,
        *e_strides,
        tokens,
        weight,
        ws,
        part,
        out,
        *o_strides,
        M,
        V,
        D,
        S1,
        chunk2,
        inv_tau,
        P_SCALE=p_scale,
        SPLIT=S2 > 1,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        BLOCK_V=block_v,
        BLOCK_S=block_s,
        num_warps=8,
        num_stages=3,
    )
    if S2 > 1:
        _reduce_kernel[tiles](
            embedding,
            *e_strides,
            tokens,
            weight,
            ws,
            part,
            out,
            *o_strides,
            M,
            V,
            D,
            S1,
            S2,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            BLOCK_S=block_s,
            num_warps=8,
        )
