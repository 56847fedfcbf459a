"""Soft embedding in Triton. Contract: dinfer_kernels/reference/soft_embedding.py.

    out[i] = E[tokens[i]] + weight[i] * softmax(z_i / tau) @ E   (masked live rows; E[tokens[i]] else)

The soft part is a GEMM over the vocabulary, P [M, V] @ E [V, d]. Two routes, by the number of rows
(route(), the shape rule; both start with the same cheap pass over z):

1. `_stats_kernel`, grid (M, S1): per vocabulary chunk, the max and sum of exp(y - max) of the row's
   y = z * (1 / tau) (chunks as in decode, so a few rows still fill the GPU). Unmasked rows skip the
   pass and keep max = -inf, which marks them (like dead rows) as having no soft part.

"one_pass" (M <= ONE_PASS_MAX_ROWS: the op is bound by reading E once, 2 V d bytes):
2. `_gemm_kernel`, a 1-D grid of (vocabulary split, M tile, d tile), the d tile fastest so that the
   programs sharing a vocabulary chunk run side by side and read its logits from L2. Each program
   merges the S1 partials into its rows' max and 1 / sum, then per BLOCK_V rows of its chunk forms
   P = exp(y - max) / sum on the fly and accumulates P @ E_slice in fp32. Every element of E is read
   by exactly one program (E streams once); each step loads a 64-row x 128-column tile of E
   (ONE_PASS_TILE) and recomputes P's 64 x 64 tile for it (d / 128 times per logit in all, under the
   step's E load time on an H200). The vocabulary is split (split-K)
   into ~GEMM_TARGET_PROGRAMS programs in all; each writes its fp32 partial to a workspace and
3. `_reduce_kernel`, grid (M tiles, d tiles), adds the partials in a fixed order (bit-identical runs)
   and runs the epilogue (with one split the GEMM's own epilogue writes out).

"gemm" (more rows: compute-bound, see ONE_PASS_MAX_ROWS): `_probs_kernel` writes P's hi and lo parts
as one [2M, V] matrix in E's dtype, one cuBLAS GEMM with fp32 output multiplies it by E, and the
epilogue adds the halves.

fp32 math as the contract: with a 16-bit E, P is split into hi + lo parts in E's dtype and both go
through the tensor cores (an fp32-accurate P at twice the MMA work); fp16 P is pre-scaled by 2**15
so that small probabilities stay normal numbers. An fp32 E uses IEEE fp32 dots, always one pass
(cuBLAS could round fp32 through TF32).
"""

from typing import Optional

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
# The shape rule between the routes (16-bit E; retune from bench_soft_embedding's rows, which time
# both). One pass reads E once (2 V d bytes: 644 MB at V 157184, d 2048, 134 us at 4.8 TB/s on an
# H200) and runs 4 M V d flops (hi and lo P): 1.29 GFLOP a row, 1.8 us a row at ~700 TFLOP/s, so it
# is bound by E up to ~75 rows. Past that both routes are compute-bound and the GEMM route gives
# the same flops to cuBLAS (a tensor-core GEMM well above what the fused Triton loop reaches),
# after writing and reading P twice (4 M V bytes, ~0.13 us a row). Torch's softmax + matmul
# (bench_soft_embedding's baseline) runs half those flops with P rounded to 16 bits, which the
# contract does not allow: at large M no route of this contract can match it (estimated ~2x at M 1024).
ONE_PASS_MAX_ROWS = 96
# The one pass's (BLOCK_V, BLOCK_D), with 8 warps and 3 stages. ptxas 12.8 for sm_90a: 216 registers
# and no spills with bf16 logits (251 with fp32 logits), while a 256-column d tile, which would halve
# the softmax recompute, spills 164-208 bytes with 8 warps (476 with 4); BLOCK_V 32 (the old tile)
# halves the bytes of E a step keeps in flight.
ONE_PASS_TILE = (64, 128)


def route(M: int, dtype: torch.dtype) -> str:
    """The route, "one_pass" or "gemm", for M rows of an embedding of `dtype` (ONE_PASS_MAX_ROWS says why)."""
    return "one_pass" if M <= ONE_PASS_MAX_ROWS or dtype == torch.float32 else "gemm"


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
    M_TILES,
    D_TILES,
    inv_tau,
    P_SCALE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # d tile fastest, then M tile, then vocabulary split: neighbours share a chunk of logits.
    pid = tl.program_id(0)
    split = pid // (M_TILES * D_TILES)
    rows = (pid // D_TILES) % M_TILES * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid % D_TILES * BLOCK_D + tl.arange(0, BLOCK_D)
    live = rows < M
    cmask = cols < D
    m, inv_total, active = _row_stats(ws, rows, live, M, S1, BLOCK_S)
    inv_total = inv_total * P_SCALE

    lo = split * CHUNK
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
        at = split.to(tl.int64) * M * D + rows[:, None] * D + cols[None, :]
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
    # A pointer stepped one partial (M D elements) at a time: the offset grows past 32 bits in 64-bit
    # pointer arithmetic, never in an int32 product.
    ptr = part + at
    for _ in range(S2):
        acc += tl.load(ptr, mask=live[:, None] & cmask[None, :], other=0.0)
        ptr += M * D
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


@triton.jit
def _probs_kernel(
    logits,
    stride_l,
    ws,
    probs,
    M,
    V,
    S1,
    CHUNK,
    inv_tau,
    P_SCALE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """The GEMM route's P, grid (M, S1): hi parts in rows [0, M) of `probs` [2M, V], lo parts in rows
    [M, 2M), in E's dtype, scaled by P_SCALE; zeros on rows without a soft part."""
    n = tl.program_id(0)
    rows = n + tl.arange(0, 1)
    m, inv_total, active = _row_stats(ws, rows, rows < M, M, S1, BLOCK_S)
    inv_total = inv_total * P_SCALE
    lo = tl.program_id(1) * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    row = logits + n.to(tl.int64) * stride_l
    out_hi = probs + n.to(tl.int64) * V
    # (M is no tensor where Triton specialises M == 1: the row index carries the 64-bit offset.)
    out_lo = probs + (n + M).to(tl.int64) * V
    for start in range(lo, hi, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        vmask = v < hi
        z = tl.load(row + v[None, :], mask=active[:, None] & vmask[None, :], other=float("-inf"))
        p = tl.exp(_sanitise(z.to(tl.float32)) * inv_tau - m[:, None]) * inv_total[:, None]
        p_hi = p.to(probs.dtype.element_ty)
        tl.store(out_hi + v[None, :], p_hi, mask=vmask[None, :])
        tl.store(
            out_lo + v[None, :], (p - p_hi.to(tl.float32)).to(probs.dtype.element_ty), mask=vmask[None, :]
        )


def _mm_fp32(a, b):
    """a @ b with fp32 output for 16-bit a and b: cuBLAS on a GPU (fp32 accumulation, no rounding of
    the product to 16 bits); on the host (the interpreter's tests) the same products in fp32."""
    if a.is_cuda:
        return torch.ops.aten.mm.dtype(a, b, torch.float32)
    return a.float() @ b.float()


def _gemm_route(logits, embedding, tokens, weight, out, ws, S1, chunk1, stats_block, inv_tau, p_scale):
    """The GEMM route (route() == "gemm"): P hi/lo by _probs_kernel, one GEMM, the epilogue in torch."""
    M, V = logits.shape
    probs = torch.empty((2 * M, V), dtype=embedding.dtype, device=logits.device)
    _probs_kernel[(M, S1)](
        logits,
        logits.stride(0),
        ws,
        probs,
        M,
        V,
        S1,
        chunk1,
        inv_tau,
        P_SCALE=p_scale,
        BLOCK_V=stats_block,
        BLOCK_S=triton.next_power_of_2(S1),
        num_warps=max(1, stats_block // 256),
    )
    halves = _mm_fp32(probs, embedding).view(2, M, -1)
    soft = (halves[0] + halves[1]) * (1.0 / p_scale)
    # As _row_stats and _epilogue: a soft part where the row max is finite; zeros for tokens outside [0, V).
    active = ws[: M * S1].view(M, S1).amax(1) > float("-inf")
    tok_ok = (tokens >= 0) & (tokens < V)
    hard = torch.where(tok_ok[:, None], embedding[tokens.clamp(0, V - 1)].float(), 0.0)
    out.copy_(hard + torch.where(active[:, None], weight[:, None] * soft, 0.0))


def soft_embedding(
    logits, embedding, tokens, weight, out, *, mask_id: int, tau: float, force_route: Optional[str] = None
) -> None:
    """force_route: "one_pass" or "gemm" instead of route()'s choice (the benchmark times both)."""
    M, V = logits.shape
    D = embedding.shape[1]
    if M == 0 or D == 0:
        return
    dev = logits.device
    inv_tau = 1.0 / float(tau)
    chosen = force_route or route(M, embedding.dtype)
    if chosen not in ("one_pass", "gemm") or (chosen == "gemm" and embedding.dtype == torch.float32):
        raise ValueError(f"force_route: expected 'one_pass' or (16-bit E) 'gemm', got {force_route!r}")

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
    p_scale = P_SCALE_FP16 if embedding.dtype == torch.float16 else 1.0
    if chosen == "gemm":
        _gemm_route(logits, embedding, tokens, weight, out, ws, S1, chunk1, stats_block, inv_tau, p_scale)
        return

    block_m = min(64, max(16, triton.next_power_of_2(M)))
    # ONE_PASS_TILE's reasons (registers) keep the d tile at 128 columns.
    block_d = min(ONE_PASS_TILE[1], max(16, triton.next_power_of_2(D)))
    block_v = min(ONE_PASS_TILE[0], max(16, triton.next_power_of_2(V)))
    tiles = (triton.cdiv(M, block_m), triton.cdiv(D, block_d))
    S2 = max(1, min(triton.cdiv(GEMM_TARGET_PROGRAMS, tiles[0] * tiles[1]), triton.cdiv(V, MIN_SPLIT_ROWS)))
    chunk2 = triton.cdiv(triton.cdiv(V, S2), block_v) * block_v
    S2 = triton.cdiv(V, chunk2)
    part = torch.empty((S2, M, D) if S2 > 1 else (0,), dtype=torch.float32, device=dev)
    block_s = triton.next_power_of_2(S1)
    e_strides = (embedding.stride(0), embedding.stride(1))
    o_strides = (out.stride(0), out.stride(1))
    _gemm_kernel[(S2 * tiles[0] * tiles[1],)](
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
        tiles[0],
        tiles[1],
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
