"""Routed mixture of experts in Triton. Contract: dinfer_kernels/reference/moe.py.

Four launches, every grid fixed by the shapes (no host sync, CUDA-graph capturable), one zeroed
4-byte counter per call:

1. `_route_kernel`, grid (cdiv(T, BT),): per tile of BT tokens, the fp32 router logits (a GEMV over H
   in IEEE fp32, or the given logits), softmax or sigmoid scores, the selection score (+ bias), the
   group-limited choice (group score = sum of its top-2 selection scores; the topk_groups best groups
   kept, lower group first on ties), the top-k (lower expert first on ties) and the weights
   (renormalised, scaled); writes topk_ids [T, k] int32 and topk_w [T, k] fp32. The last program to
   finish (an acq_rel ticket on the counter) then runs the alignment for everyone (`_align`):
   per-expert counts over the local experts [e0, e1) (w13 / w2 hold those only: e0 is the
   expert_offset), each expert's segment padded to BLOCK_M, the
   permuted list `sorted_ids` of flat slots t*k + j (token-major inside each expert, so the order is
   deterministic) with the sentinel T*k in the padding, and the expert of every BLOCK_M block
   (`block_expert`: the local expert, -1 past the end). Sizes are worst-case: P_MAX = T*k' +
   touched*(BLOCK_M - 1) rows, k' = min(k, e1 - e0) (k for a given top-k, whose rows may repeat an
   expert), touched = min(e1 - e0, T*k'). (`ONE_LAUNCH = False` runs the alignment as a separate
   single-program kernel instead, with no ticket.) A given top-k (topk_ids / topk_weights) replaces
   the routing: copied into topk_ids / topk_w, then the alignment's own launch.
   A shared expert [2S, H] / [H, S] runs as n_virt = cdiv(S, I) virtual experts of width I (the last
   one narrower) after the local ones, each taking every token with weight 1: T more slots each
   (T*k + v*T + t, after the routed ones; the sentinel is then T*(k + n_virt)) and a segment of
   cdiv(T, BLOCK_M) blocks each in P_MAX. Their weights are read in place (gate rows v*I.., up rows
   S + v*I.., w2 columns v*I.. with row stride S): no copy, no launch of their own.
2. `_gemm1_kernel`, grid (P_MAX / BLOCK_M, cdiv(I, BN1)): the block's rows of hidden (gathered by
   token) times the gate *and* the up rows of its expert's w13 (two accumulators), SiLU(g) * u in
   fp32 in the epilogue, rounded to the dtype, written to act [P_MAX, I] at the block's rows (the
   padding rows get 0). Blocks of no expert return at once.
3. `_gemm2_kernel`, grid (P_MAX / BLOCK_M, cdiv(H, BN2), SPLIT_K): act times the expert's w2 over a
   K range, times the routing weight (1 for a virtual expert), fp32, written to the slot's row of
   part [SPLIT_K, T*(k + n_virt), H].
4. `_combine_kernel`, grid (cdiv(T, BT), cdiv(H, BH)): out[t] = sum over slots j (then splits s) in
   that fixed order of part[s, t*k + j], for the slots whose expert is local, then the virtual
   experts' slots in order; no atomics, so the result is bit-identical run to run.

FP8 weights (float8_e4m3fn, 128 x 128 block scales, dinfer_kernels/fp8.py): the GEMMs load the e4m3
tile, multiply it in fp32 by its block's scale (one per output row: every BK divides 128, so a K tile
lies in one scale column; a virtual expert whose columns start mid-block takes two in GEMM 2) and
round it to the activations' dtype, then the usual dot: exactly fp8_block_dequantize's weights.

Tiles are chosen from the shapes only (`choose_config`): about k*T / experts rows per expert pick
BLOCK_M in {16, 32, 64, 128}; at 16-32 rows (the diffusion window, ~12 rows per expert) the GEMMs
stream weights: narrow N tiles so that all (expert, N tile) programs give >= 2 per SM of an H200, and
a K split of GEMM 2 when that is not enough (one token, a few experts).
"""

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import fp8
from .._moe_layout import given_topk

# Programs wanted per launch: 2 per SM of an H200 (132 SMs). A constant, so tiles (and the summation
# order of the split-K combine) do not depend on the device.
TARGET_PROGRAMS = 2 * 132
RENORM_EPS = tl.constexpr(1e-20)
FP8_BLOCK = tl.constexpr(fp8.FP8_BLOCK)
FP8_DTYPE = fp8.FP8_DTYPE
# Run the alignment in the last routing program (one launch) or as its own launch.
ONE_LAUNCH = True
# Element budgets of the broadcast-multiply router tile [BT, E_PAD, BK] (64 fp32 registers per thread
# at 4 warps) and of the alignment tiles [CH, EL_PAD].
ROUTE_TILE = 8192
ALIGN_TILE = 8192
SMEM_BUDGET = 160 * 1024


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    bn1: int
    bk1: int
    warps1: int
    stages1: int
    bn2: int
    bk2: int
    split_k: int
    warps2: int
    stages2: int
    route_bt: int
    route_dot: bool
    one_launch: bool = ONE_LAUNCH
    # The expert GEMMs: ours ("triton") or torch._grouped_mm behind our routing and combine
    # ("grouped_mm", below: experts_grouped_mm; an override until a GPU run shows where it wins).
    gemm: str = "triton"


def _interpreted():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(x):
    return triton.next_power_of_2(max(1, int(x)))


def _stages(per_stage_bytes, most=4):
    return max(2, min(most, SMEM_BUDGET // max(1, per_stage_bytes)))


def choose_config(T, top_k, E, e_loc, H, I, dtype, *, n_virt=0, weight_dtype=None) -> MoeConfig:
    """Tiles from the shapes alone (deterministic; the same on every device). n_virt: the virtual
    experts of a shared expert (T rows each); weight_dtype: the experts' (FP8: 1 byte), default dtype.
    Every BK is a power of two <= 128, so it divides an FP8 scale block."""
    item = torch.empty((), dtype=dtype).element_size()
    w_item = torch.empty((), dtype=weight_dtype or dtype).element_size()
    k_eff = min(top_k, e_loc)
    n = max(1, T * k_eff)
    touched = max(1, min(e_loc, n))
    rows = n / touched  # mean rows per touched (routed) expert
    block_m = min(128, max(16, _pow2(rows)))
    bk = 128 if item == 2 else 64
    busy = touched + n_virt  # experts with rows, virtual ones included
    if block_m <= 32:  # weight streaming: many narrow programs
        bn1 = next((b for b in (64, 32) if busy * triton.cdiv(I, b) >= TARGET_PROGRAMS), 16)
        bn2 = next((b for b in (64, 32) if busy * triton.cdiv(H, b) >= TARGET_PROGRAMS), 32)
        progs = busy * triton.cdiv(H, bn2)
        split = 1
        if progs < TARGET_PROGRAMS:
            split = max(1, min(triton.cdiv(TARGET_PROGRAMS, progs), triton.cdiv(I, 2 * bk)))
        warps1 = warps2 = 4
    else:
        bn1, bn2, split = 64, 128 if block_m == 128 else 64, 1
        bk = 64
        warps1 = warps2 = 8 if block_m == 128 else 4
    bk1 = min(bk, max(16, _pow2(H)))
    bk2 = min(bk, max(16, _pow2(triton.cdiv(I, split))))
    stages1 = _stages((block_m * item + 2 * bn1 * w_item) * bk1)
    stages2 = _stages((block_m * item + bn2 * w_item) * bk2)
    e_pad = max(16, _pow2(E))
    route_dot = T >= 256
    if route_dot:
        route_bt = 32
    else:
        route_bt = max(1, min(16, ROUTE_TILE // (e_pad * _route_bk(e_pad, H, False))))
    return MoeConfig(
        block_m, bn1, bk1, warps1, stages1, bn2, bk2, split, warps2, stages2, route_bt, route_dot
    )


def _route_bk(e_pad, H, dot):
    """K step of the router GEMV: 64 for a dot over <= 64 experts, else 32."""
    return min(64 if dot and e_pad <= 64 else 32, max(16, _pow2(H)))


def buffer_sizes(T, top_k, e_loc, block_m, distinct=True, n_virt=0):
    """(P_MAX rows of the padded permuted list, number of BLOCK_M blocks) for the worst case;
    distinct: a token's experts are distinct (a router's are; a given top-k's need not be);
    n_virt virtual experts (a shared expert's) of T rows each after the local ones."""
    k_eff = min(top_k, e_loc) if distinct else top_k
    n = T * k_eff
    touched = min(e_loc, n)
    p_max = n + touched * (block_m - 1)
    if distinct:
        p_max = min(p_max, e_loc * triton.cdiv(T, block_m) * block_m)
    p_max += n_virt * triton.cdiv(T, block_m) * block_m
    nb = triton.cdiv(p_max, block_m)
    return nb * block_m, nb


# ------------------------------------------------------------------------------------------ routing
@triton.jit
def _router_logits(
    hidden,
    s_ht,
    s_hh,
    rw,
    s_re,
    s_rh,
    logits_in,
    s_lt,
    s_le,
    rows,
    live,
    ex,
    emask,
    H,
    HAS_LOGITS: tl.constexpr,
    BT: tl.constexpr,
    E_PAD: tl.constexpr,
    BK: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    rows64 = rows.to(tl.int64)
    if HAS_LOGITS:
        ptr = logits_in + rows64[:, None] * s_lt + ex[None, :] * s_le
        logits = tl.load(ptr, mask=live[:, None] & emask[None, :], other=0.0).to(tl.float32)
    else:
        logits = tl.zeros([BT, E_PAD], tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            x = tl.load(
                hidden + rows64[:, None] * s_ht + kk[None, :] * s_hh,
                mask=live[:, None] & km[None, :],
                other=0.0,
            ).to(tl.float32)
            w = tl.load(
                rw + ex[:, None] * s_re + kk[None, :] * s_rh, mask=emask[:, None] & km[None, :], other=0.0
            ).to(tl.float32)
            if USE_DOT:
                logits = tl.dot(x, tl.trans(w), logits, input_precision="ieee")
            else:
                logits += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return logits


@triton.jit
def _pick_max(vals, idx, PAD: tl.constexpr):
    """Per row: the max of vals and the lowest index holding it (clamped into range)."""
    best = tl.max(vals, 1)
    at = tl.min(tl.where(vals == best[:, None], idx[None, :], PAD), 1)
    return best, tl.minimum(at, PAD - 1)


@triton.jit
def _group_mask(
    sel,
    ex,
    emask,
    num_groups,
    group_size,
    topk_groups,
    BT: tl.constexpr,
    E_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
):
    """True on the experts of the topk_groups best groups (group score: sum of the top-2)."""
    grp = ex // group_size
    gx = tl.arange(0, G_PAD)
    gscore = tl.full([BT, G_PAD], float("-inf"), tl.float32)
    for g in range(num_groups):
        v = tl.where((grp == g)[None, :] & emask[None, :], sel, float("-inf"))
        m1, i1 = _pick_max(v, ex, E_PAD)
        m2 = tl.max(tl.where(ex[None, :] == i1[:, None], float("-inf"), v), 1)
        score = tl.where(group_size == 1, m1, m1 + m2)  # a one-expert group: its one score
        gscore = tl.where(gx[None, :] == g, score[:, None], gscore)
    keep = tl.zeros([BT, E_PAD], tl.int32)
    for _ in range(topk_groups):
        _, gi = _pick_max(gscore, gx, G_PAD)
        keep = tl.where(grp[None, :] == gi[:, None], 1, keep)
        gscore = tl.where(gx[None, :] == gi[:, None], float("-inf"), gscore)
    return keep != 0


@triton.jit
def _align(
    topk_ids,
    sorted_ids,
    block_expert,
    meta,
    T,
    n_assign,
    e0,
    e_loc,
    n_virt,
    nb_max,
    BLOCK_M: tl.constexpr,
    EL_PAD: tl.constexpr,
    CH: tl.constexpr,
    NBC: tl.constexpr,
):
    """Counts, padded offsets, the permuted slot list and the block -> expert map (one program).
    The n_virt virtual experts of a shared expert follow the local ones, each with every token:
    virtual expert v holds the slots n_assign + v*T + t, t in [0, T)."""
    el = tl.arange(0, EL_PAD)
    elm = el < e_loc  # the routed experts (a routed id past them is another rank's, never virtual)
    allm = el < e_loc + n_virt
    counts = tl.where(allm & ~elm, T, 0)
    for f0 in range(0, n_assign, CH):
        f = f0 + tl.arange(0, CH)
        loc = tl.load(topk_ids + f, mask=f < n_assign, other=-1, cache_modifier=".cg") - e0
        hit = (loc[:, None] == el[None, :]) & elm[None, :]
        counts += tl.sum(hit.to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    # Each slot goes to start[e] + (number of earlier slots of expert e): token-major within an expert.
    running = starts
    for f0 in range(0, n_assign, CH):
        f = f0 + tl.arange(0, CH)
        loc = tl.load(topk_ids + f, mask=f < n_assign, other=-1, cache_modifier=".cg") - e0
        hit = (loc[:, None] == el[None, :]) & elm[None, :]
        hit_i = hit.to(tl.int32)
        rank = tl.cumsum(hit_i, 0) - 1 + running[None, :]
        pos = tl.sum(tl.where(hit, rank, 0), 1)
        tl.store(sorted_ids + pos, f, mask=tl.sum(hit_i, 1) > 0)
        running += tl.sum(hit_i, 0)
    for v in range(n_virt):
        start = tl.sum(tl.where(el == e_loc + v, starts, 0), 0)
        for t0 in range(0, T, CH):
            t = t0 + tl.arange(0, CH)
            tl.store(sorted_ids + start + t, n_assign + v * T + t, mask=t < T)
    r = tl.arange(0, BLOCK_M)
    pad_pos = (starts + counts)[:, None] + r[None, :]
    sentinel = n_assign + n_virt * T
    tl.store(sorted_ids + pad_pos, sentinel, mask=allm[:, None] & (pad_pos < ends[:, None]))
    block_end = ends // BLOCK_M
    n_blocks = total // BLOCK_M
    for b0 in range(0, nb_max, NBC):
        b = b0 + tl.arange(0, NBC)
        local = tl.sum(((block_end[None, :] <= b[:, None]) & allm[None, :]).to(tl.int32), 1)
        tl.store(block_expert + b, tl.where(b < n_blocks, local, -1), mask=b < nb_max)
    tl.store(meta + 1, total)


@triton.jit
def _route_kernel(
    hidden,
    s_ht,
    s_hh,
    rw,
    s_re,
    s_rh,
    logits_in,
    s_lt,
    s_le,
    bias,
    topk_ids,
    topk_w,
    sorted_ids,
    block_expert,
    meta,
    T,
    H,
    E,
    num_groups,
    group_size,
    topk_groups,
    scaling,
    e0,
    e_loc,
    n_virt,
    nb_max,
    HAS_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SIGMOID: tl.constexpr,
    GROUPED: tl.constexpr,
    RENORM: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BT: tl.constexpr,
    E_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    BK: tl.constexpr,
    USE_DOT: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EL_PAD: tl.constexpr,
    CH: tl.constexpr,
    NBC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    live = rows < T
    ex = tl.arange(0, E_PAD)
    emask = ex < E
    logits = _router_logits(
        hidden,
        s_ht,
        s_hh,
        rw,
        s_re,
        s_rh,
        logits_in,
        s_lt,
        s_le,
        rows,
        live,
        ex,
        emask,
        H,
        HAS_LOGITS,
        BT,
        E_PAD,
        BK,
        USE_DOT,
    )
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-logits))
    else:
        z = tl.where(emask[None, :], logits, float("-inf"))
        p = tl.exp(z - tl.max(z, 1)[:, None])
        score = p / tl.sum(p, 1)[:, None]
    sel = score
    if HAS_BIAS:
        sel = sel + tl.load(bias + ex, mask=emask, other=0.0).to(tl.float32)[None, :]
    if SIGMOID:
        wsrc = score
    else:
        wsrc = sel
    sel = tl.where(emask[None, :] & (sel == sel), sel, float("-inf"))  # NaN ranks like -inf
    if GROUPED:
        sel = tl.where(
            _group_mask(sel, ex, emask, num_groups, group_size, topk_groups, BT, E_PAD, G_PAD),
            sel,
            float("-inf"),
        )
    kx = tl.arange(0, K_PAD)
    ids = tl.zeros([BT, K_PAD], tl.int32)
    wts = tl.zeros([BT, K_PAD], tl.float32)
    for j in range(TOP_K):
        _, idx = _pick_max(sel, ex, E_PAD)
        hit = ex[None, :] == idx[:, None]
        wj = tl.sum(tl.where(hit, wsrc, 0.0), 1)
        ids = tl.where(kx[None, :] == j, idx[:, None], ids)
        wts = tl.where(kx[None, :] == j, wj[:, None], wts)
        sel = tl.where(hit, float("-inf"), sel)
    if RENORM:
        wts = wts / (tl.sum(wts, 1) + RENORM_EPS)[:, None]
    wts = wts * scaling
    at = rows[:, None] * TOP_K + kx[None, :]
    ok = live[:, None] & (kx[None, :] < TOP_K)
    tl.store(topk_ids + at, ids, mask=ok)
    tl.store(topk_w + at, wts, mask=ok)
    if ALIGN:
        # Every thread's stores are ordered before the release by the barrier; the last program's
        # acquire makes all programs' topk_ids visible to it.
        tl.debug_barrier()
        ticket = tl.atomic_add(meta, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:
            _align(
                topk_ids,
                sorted_ids,
                block_expert,
                meta,
                T,
                T * TOP_K,
                e0,
                e_loc,
                n_virt,
                nb_max,
                BLOCK_M,
                EL_PAD,
                CH,
                NBC,
            )


@triton.jit
def _align_kernel(
    topk_ids,
    sorted_ids,
    block_expert,
    meta,
    T,
    n_assign,
    e0,
    e_loc,
    n_virt,
    nb_max,
    BLOCK_M: tl.constexpr,
    EL_PAD: tl.constexpr,
    CH: tl.constexpr,
    NBC: tl.constexpr,
):
    _align(
        topk_ids,
        sorted_ids,
        block_expert,
        meta,
        T,
        n_assign,
        e0,
        e_loc,
        n_virt,
        nb_max,
        BLOCK_M,
        EL_PAD,
        CH,
        NBC,
    )


# -------------------------------------------------------------------------------------------- GEMMs
@triton.jit
def _token(slot, n_assign, T, TOP_K: tl.constexpr):
    """The token of a slot: t*k + j for a routed pair, n_assign + v*T + t for virtual expert v."""
    return tl.where(slot < n_assign, slot // TOP_K, (slot - n_assign) % T).to(tl.int64)


@triton.jit
def _gemm1_kernel(
    hidden,
    s_ht,
    s_hh,
    w13,
    s_we,
    s_wn,
    s_wk,
    shared_w13,
    s_sn,
    w13_scale,
    s_ce,
    s_cn,
    shared_scale,
    s_dn,
    act,
    sorted_ids,
    block_expert,
    n_assign,
    n_slots,
    T,
    H,
    I,
    S,
    e_loc,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
    SHARED: tl.constexpr,
    FP8: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if e < 0:
        return
    p = b * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids + p)
    valid = slot < n_slots
    tok = _token(slot, n_assign, T, TOP_K)
    # Expert e's gate rows [0, I) and up rows [I, 2I); past the local experts, virtual expert v of the
    # shared expert: its gate rows v*I.. (the last one narrower) and up rows S further, read in place.
    w = w13 + e.to(tl.int64) * s_we
    s_n = s_wn
    row0 = 0
    half = I
    width = I
    if SHARED:
        v = e - e_loc
        sh = v >= 0
        w = tl.where(sh, shared_w13, w)
        s_n = tl.where(sh, s_sn, s_wn)
        row0 = tl.where(sh, v * I, 0)
        half = tl.where(sh, S, I)
        width = tl.where(sh, tl.minimum(I, S - row0), I)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < width
    rows = row0 + cols
    w_gate = w + rows[:, None].to(tl.int64) * s_n
    w_up = w_gate + half * s_n
    if FP8:
        # The 128 x 128 block scales of those rows (each half its own block rows); BK divides 128,
        # so a K tile lies in one scale column.
        sc = w13_scale + e.to(tl.int64) * s_ce
        s_c = s_cn
        if SHARED:
            sc = tl.where(sh, shared_scale, sc)
            s_c = tl.where(sh, s_dn, s_cn)
        sc_gate = sc + (rows // FP8_BLOCK).to(tl.int64) * s_c
        sc_up = sc_gate + (half + FP8_BLOCK - 1) // FP8_BLOCK * s_c
    acc_g = tl.zeros([BLOCK_M, BN], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BN], tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < H
        a = tl.load(
            hidden + tok[:, None] * s_ht + kk[None, :] * s_hh, mask=valid[:, None] & km[None, :], other=0.0
        )
        wm = cm[:, None] & km[None, :]
        g = tl.load(w_gate + kk[None, :] * s_wk, mask=wm, other=0.0)
        u = tl.load(w_up + kk[None, :] * s_wk, mask=wm, other=0.0)
        if FP8:  # the contract's dequantisation: fp32 product, rounded to the activations' dtype
            blk = k0 // FP8_BLOCK
            g = (g.to(tl.float32) * tl.load(sc_gate + blk, mask=cm, other=1.0)[:, None]).to(a.dtype)
            u = (u.to(tl.float32) * tl.load(sc_up + blk, mask=cm, other=1.0)[:, None]).to(a.dtype)
        if IEEE:
            acc_g = tl.dot(a, tl.trans(g), acc_g, input_precision="ieee")
            acc_u = tl.dot(a, tl.trans(u), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, tl.trans(g), acc_g)
            acc_u = tl.dot(a, tl.trans(u), acc_u)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(act + p.to(tl.int64)[:, None] * I + cols[None, :], h.to(act.dtype.element_ty), mask=cm[None, :])


@triton.jit
def _gemm2_kernel(
    act,
    w2,
    s_we,
    s_wn,
    s_wk,
    shared_w2,
    s_sn,
    w2_scale,
    s_ce,
    s_cn,
    shared_scale,
    s_dn,
    part,
    topk_w,
    sorted_ids,
    block_expert,
    n_assign,
    n_slots,
    H,
    I,
    S,
    e_loc,
    K_CHUNK,
    BLOCK_M: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
    SHARED: tl.constexpr,
    FP8: tl.constexpr,
    STRADDLE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if e < 0:
        return
    s = tl.program_id(2)
    p = b * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids + p)
    valid = slot < n_slots
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < H
    # Expert e's w2 [H, I]; past the local experts, virtual expert v of the shared expert: the
    # columns v*I.. of shared_w2 [H, S] (the last one narrower), read in place.
    w = w2 + e.to(tl.int64) * s_we
    s_n = s_wn
    col0 = 0
    width = I
    if SHARED:
        v = e - e_loc
        sh = v >= 0
        w = tl.where(sh, shared_w2, w)
        s_n = tl.where(sh, s_sn, s_wn)
        col0 = tl.where(sh, v * I, 0)
        width = tl.where(sh, tl.minimum(I, S - col0), I)
    w_rows = w + cols[:, None].to(tl.int64) * s_n + col0 * s_wk
    if FP8:
        sc = w2_scale + e.to(tl.int64) * s_ce
        s_c = s_cn
        if SHARED:
            sc = tl.where(sh, shared_scale, sc)
            s_c = tl.where(sh, s_dn, s_cn)
        sc_rows = sc + (cols // FP8_BLOCK).to(tl.int64) * s_c
    a_rows = act + p.to(tl.int64)[:, None] * I
    lo = s * K_CHUNK
    hi = tl.minimum(lo + K_CHUNK, width)
    acc = tl.zeros([BLOCK_M, BN], tl.float32)
    for k0 in range(lo, hi, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < hi
        a = tl.load(a_rows + kk[None, :], mask=km[None, :], other=0.0)
        wt = tl.load(w_rows + kk[None, :] * s_wk, mask=cm[:, None] & km[None, :], other=0.0)
        if FP8:
            first = (col0 + k0) // FP8_BLOCK
            scale = tl.load(sc_rows + first, mask=cm, other=1.0)[:, None]
            if STRADDLE:  # a virtual expert starts mid-block: its tiles may reach into the next column
                last = (col0 + tl.minimum(k0 + BK, hi) - 1) // FP8_BLOCK
                after = tl.load(sc_rows + last, mask=cm, other=1.0)[:, None]
                scale = tl.where(((col0 + kk) // FP8_BLOCK == first)[None, :], scale, after)
            wt = (wt.to(tl.float32) * scale).to(a.dtype)
        if IEEE:
            acc = tl.dot(a, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(wt), acc)
    # The routing weight of a routed slot; 1 for the shared expert's.
    weight = tl.load(topk_w + slot, mask=valid & (slot < n_assign), other=1.0)
    acc = acc * weight[:, None]
    at = (s * n_slots + slot).to(tl.int64)[:, None] * H + cols[None, :]
    tl.store(part + at, acc, mask=valid[:, None] & cm[None, :])


@triton.jit
def _combine_kernel(
    part,
    topk_ids,
    out,
    s_ot,
    s_oh,
    T,
    H,
    n_assign,
    n_slots,
    n_virt,
    e0,
    e1,
    SPLIT,
    TOP_K: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    live = rows < T
    cm = cols < H
    acc = tl.zeros([BT, BH], tl.float32)
    for j in range(TOP_K):
        slot = rows * TOP_K + j
        eid = tl.load(topk_ids + slot, mask=live, other=-1)
        ok = live & (eid >= e0) & (eid < e1)
        for s in range(SPLIT):
            at = (s * n_slots + slot).to(tl.int64)[:, None] * H + cols[None, :]
            acc += tl.load(part + at, mask=ok[:, None] & cm[None, :], other=0.0)
    for v in range(n_virt):  # the shared expert's slots after the routed ones: a fixed order
        slot = n_assign + v * T + rows
        for s in range(SPLIT):
            at = (s * n_slots + slot).to(tl.int64)[:, None] * H + cols[None, :]
            acc += tl.load(part + at, mask=live[:, None] & cm[None, :], other=0.0)
    o = out + rows.to(tl.int64)[:, None] * s_ot + cols[None, :] * s_oh
    tl.store(o, acc.to(out.dtype.element_ty), mask=live[:, None] & cm[None, :])


# ------------------------------------------------------------------------ GEMMs by torch._grouped_mm
# The expert GEMMs delegated to torch._grouped_mm (CUTLASS's sm90 grouped GEMM on Hopper), behind our
# routing, alignment and combine: the large-batch path of issue 40's plan, to be chosen over our own
# GEMMs where a GPU run measures it faster (MoeConfig.gemm = "grouped_mm": today a config override that
# bench_moe times beside the default). After the routing/alignment (BLOCK_M = GROUPED_BLOCK_M, so each
# expert's rows are padded by at most 15): the offsets of each local expert's padded segment (from
# block_expert, static shapes); the rows of hidden gathered in the permuted order; GEMM 1 into [P, 2I]
# in the dtype (the reference's rounding of g, u); `_silu_mul_kernel`; GEMM 2 into [P, H] in the dtype
# (the reference's rounding of W2·a); `_scatter_kernel` (routing weight, fp32, the routed rows only);
# a shared expert as two dense matmuls into the first virtual slot; the ordered combine. Every shape
# is fixed by the call's (the offsets stay on the device): CUDA-graph capturable. Weights in the
# activations' dtype only (torch._grouped_mm takes no block scales).
# Rows per alignment block: _grouped_mm needs no tile padding, so the smallest block the alignment
# takes keeps the padded rows (computed, never read) under 16 per expert.
GROUPED_BLOCK_M = 16


@triton.jit
def _silu_mul_kernel(gu, act, block_expert, P, I, e_loc, BLOCK_M, BR: tl.constexpr, BI: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    e = tl.load(block_expert + rows // BLOCK_M, mask=rows < P, other=-1)
    m = ((e >= 0) & (e < e_loc))[:, None] & (cols < I)[None, :]  # rows GEMM 1 wrote
    at = rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
    g = tl.load(gu + at, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + at + I, mask=m, other=0.0).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(act + rows.to(tl.int64)[:, None] * I + cols[None, :], h.to(act.dtype.element_ty), mask=m)


@triton.jit
def _scatter_kernel(
    y,
    sorted_ids,
    block_expert,
    topk_w,
    part,
    P,
    H,
    n_assign,
    e_loc,
    BLOCK_M,
    BR: tl.constexpr,
    BH: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    # Only the rows of the routed experts' blocks hold slots (sorted_ids past the last block is unwritten).
    e = tl.load(block_expert + rows // BLOCK_M, mask=rows < P, other=-1)
    mine = (e >= 0) & (e < e_loc)
    slot = tl.load(sorted_ids + rows, mask=mine, other=n_assign)
    routed = mine & (slot < n_assign)
    m = routed[:, None] & (cols < H)[None, :]
    w = tl.load(topk_w + slot, mask=routed, other=0.0)
    v = tl.load(y + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(part + slot.to(tl.int64)[:, None] * H + cols[None, :], v * w[:, None], mask=m)


def _offsets(block_expert, e_loc, block_m):
    """[e_loc] int32: the end row of each local expert's padded segment (virtual experts' blocks and
    unused ones, -1, counted in a spare bin)."""
    bins = torch.where((block_expert >= 0) & (block_expert < e_loc), block_expert, e_loc).long()
    blocks = torch.zeros(e_loc + 1, dtype=torch.int32, device=block_expert.device)
    blocks.scatter_add_(0, bins, torch.ones_like(block_expert))
    return (torch.cumsum(blocks[:e_loc], 0) * block_m).to(torch.int32)


def experts_grouped_mm(hidden, w13, w2, top_k, ws, *, shared_w13=None, shared_w2=None):
    """GEMMs 1 and 2 and the shared expert into ws.part[0] (the combine is the caller's, SPLIT = 1)."""
    T, H = hidden.shape
    e_loc, two_i, _ = w13.shape
    I = two_i // 2
    P, n = ws.p_max, ws.n_assign
    block_m = P // ws.nb_max
    # The rows of the routed experts' blocks gather their token (sorted_ids elsewhere: unwritten).
    e = ws.block_expert.repeat_interleave(block_m)
    slots = ws.sorted_ids.long()
    routed = (e >= 0) & (e < e_loc) & (slots < n)
    rows = hidden.index_select(0, torch.where(routed, slots // top_k, 0))
    offs = _offsets(ws.block_expert, e_loc, block_m)
    gu = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
    act = ws.act
    br, bi = 16, min(256, triton.next_power_of_2(I))
    _silu_mul_kernel[(triton.cdiv(P, br), triton.cdiv(I, bi))](
        gu, act, ws.block_expert, P, I, e_loc, block_m, BR=br, BI=bi
    )
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    bh = min(256, triton.next_power_of_2(H))
    _scatter_kernel[(triton.cdiv(P, br), triton.cdiv(H, bh))](
        y, ws.sorted_ids, ws.block_expert, ws.topk_w, ws.part, P, H, n, e_loc, block_m, BR=br, BH=bh
    )
    if shared_w13 is not None:
        # The whole shared expert into the first virtual slot (the others, if any, hold zeros):
        # two dense GEMMs, rounded where the reference rounds.
        g, u = (hidden @ shared_w13.t()).chunk(2, dim=-1)
        a = (F.silu(g.float()) * u.float()).to(hidden.dtype)
        virtual = ws.part[0, n:].view(ws.n_virt, T, H)
        virtual[0] = (a @ shared_w2.t()).float()
        virtual[1:] = 0


# ------------------------------------------------------------------------------------------ driver
def virtual_experts(I, S):
    """How many virtual experts of width I (the last one narrower) run a shared expert of width S."""
    return triton.cdiv(S, I) if S else 0


class Workspace:
    """The device buffers of one call (exposed for tests and the benchmark's plain-GEMM baseline).
    Slots: the routed pairs t*k + j, then the n_virt virtual experts' n_assign + v*T + t."""

    def __init__(self, T, top_k, e_loc, I, H, dtype, device, cfg, distinct=True, n_virt=0):
        self.p_max, self.nb_max = buffer_sizes(T, top_k, e_loc, cfg.block_m, distinct, n_virt)
        self.T, self.n_virt = T, n_virt
        self.n_assign = n = T * top_k
        self.n_slots = n + n_virt * T
        self.meta = torch.zeros(2, dtype=torch.int32, device=device)  # [ticket, padded rows]
        self.topk_ids = torch.empty(n, dtype=torch.int32, device=device)
        self.topk_w = torch.empty(n, dtype=torch.float32, device=device)
        self.sorted_ids = torch.empty(self.p_max, dtype=torch.int32, device=device)
        self.block_expert = torch.empty(self.nb_max, dtype=torch.int32, device=device)
        self.act = torch.empty((self.p_max, I), dtype=dtype, device=device)
        self.part = torch.empty((cfg.split_k, self.n_slots, H), dtype=torch.float32, device=device)


def _align_args(e_loc, cfg, n_virt=0):
    """The alignment's tile constants (_align, fused in the route kernel or its own launch) for a
    slice of e_loc local experts and n_virt virtual ones."""
    el_pad = max(16, _pow2(e_loc + n_virt))
    return dict(
        BLOCK_M=cfg.block_m,
        EL_PAD=el_pad,
        CH=max(16, ALIGN_TILE // el_pad),
        NBC=max(16, ALIGN_TILE // el_pad),
    )


def _align_launch(ws, e0, e_loc, cfg):
    """The alignment as its own single-program launch."""
    _align_kernel[(1,)](
        ws.topk_ids,
        ws.sorted_ids,
        ws.block_expert,
        ws.meta,
        ws.T,
        ws.n_assign,
        e0,
        e_loc,
        ws.n_virt,
        ws.nb_max,
        **_align_args(e_loc, cfg, ws.n_virt),
        num_warps=4,
    )


def route_and_align(
    hidden,
    router_weight,
    router_logits,
    top_k,
    renormalize,
    scoring,
    expert_bias,
    num_groups,
    topk_groups,
    routed_scaling,
    e0,
    e1,
    E,
    cfg,
    ws,
):
    """Launch 1 (and the separate alignment launch when cfg.one_launch is False)."""
    T, H = hidden.shape
    e_loc = e1 - e0
    e_pad = max(16, _pow2(E))
    has_logits = router_logits is not None
    lg = router_logits if has_logits else hidden
    rw = hidden if has_logits else router_weight
    bias = expert_bias if expert_bias is not None else ws.topk_w
    bt = cfg.route_bt
    _route_kernel[(triton.cdiv(T, bt),)](
        hidden,
        hidden.stride(0),
        hidden.stride(1),
        rw,
        rw.stride(0),
        rw.stride(1),
        lg,
        lg.stride(0),
        lg.stride(1),
        bias,
        ws.topk_ids,
        ws.topk_w,
        ws.sorted_ids,
        ws.block_expert,
        ws.meta,
        T,
        H,
        E,
        num_groups,
        E // num_groups,
        topk_groups,
        float(routed_scaling),
        e0,
        e_loc,
        ws.n_virt,
        ws.nb_max,
        HAS_LOGITS=has_logits,
        HAS_BIAS=expert_bias is not None,
        SIGMOID=scoring == "sigmoid",
        GROUPED=num_groups > 1,
        RENORM=bool(renormalize),
        TOP_K=top_k,
        K_PAD=_pow2(top_k),
        BT=bt,
        E_PAD=e_pad,
        G_PAD=_pow2(num_groups),
        BK=_route_bk(e_pad, H, cfg.route_dot),
        USE_DOT=cfg.route_dot,
        ALIGN=cfg.one_launch,
        **_align_args(e_loc, cfg, ws.n_virt),
        num_warps=4 if e_pad <= 64 else 8,
    )
    if not cfg.one_launch:
        _align_launch(ws, e0, e_loc, cfg)


def _strides(t, n):
    """t's last n strides, or n zeros for an absent tensor."""
    return t.stride()[-n:] if t is not None else (0,) * n


def experts(
    hidden,
    w13,
    w2,
    top_k,
    e0,
    e1,
    out,
    cfg,
    ws,
    *,
    shared_w13=None,
    shared_w2=None,
    w13_scale=None,
    w2_scale=None,
    shared_w13_scale=None,
    shared_w2_scale=None,
):
    """Launches 2-4: GEMM 1 (+SiLU*mul), GEMM 2 (+routing weight), the ordered combine; with a
    shared expert (ws.n_virt virtual experts after the local ones) and FP8 weights when given."""
    T, H = hidden.shape
    I = w13.shape[1] // 2
    S = shared_w13.shape[0] // 2 if shared_w13 is not None else 0
    shared = S > 0
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 and (FP8_BLOCK.value % cfg.bk1 or FP8_BLOCK.value % cfg.bk2):
        raise ValueError(
            f"config: bk1={cfg.bk1}, bk2={cfg.bk2} must divide {FP8_BLOCK.value} for FP8 weights"
        )
    if shared:
        # One K stride for the routed and the shared weights (a select of two would hide a stride
        # of 1 from the compiler, and with it the vectorised loads): the same when both are
        # contiguous, as loaded weights are; anything else is made so.
        if shared_w13.stride(-1) != w13.stride(-1):
            w13, shared_w13 = w13.contiguous(), shared_w13.contiguous()
        if shared_w2.stride(-1) != w2.stride(-1):
            w2, shared_w2 = w2.contiguous(), shared_w2.contiguous()
    # Absent tensors: any pointer of the right kind stands in (their code is compiled out).
    sw13, sw2 = (shared_w13, shared_w2) if shared else (w13, w2)
    dummy = ws.topk_w
    s13, s2 = (w13_scale, w2_scale) if fp8 else (dummy, dummy)
    ss13, ss2 = (shared_w13_scale, shared_w2_scale) if fp8 and shared else (dummy, dummy)
    ieee = hidden.dtype == torch.float32
    _gemm1_kernel[(ws.nb_max, triton.cdiv(I, cfg.bn1))](
        hidden,
        hidden.stride(0),
        hidden.stride(1),
        w13,
        *w13.stride(),
        sw13,
        sw13.stride(-2),
        s13,
        *_strides(w13_scale, 3)[:2],
        ss13,
        _strides(shared_w13_scale, 2)[0],
        ws.act,
        ws.sorted_ids,
        ws.block_expert,
        ws.n_assign,
        ws.n_slots,
        T,
        H,
        I,
        S,
        e1 - e0,
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BN=cfg.bn1,
        BK=cfg.bk1,
        IEEE=ieee,
        SHARED=shared,
        FP8=fp8,
        num_warps=cfg.warps1,
        num_stages=cfg.stages1,
    )
    k_chunk = triton.cdiv(triton.cdiv(I, cfg.split_k), cfg.bk2) * cfg.bk2
    split = triton.cdiv(I, k_chunk)
    assert split <= cfg.split_k
    _gemm2_kernel[(ws.nb_max, triton.cdiv(H, cfg.bn2), split)](
        ws.act,
        w2,
        *w2.stride(),
        sw2,
        sw2.stride(-2),
        s2,
        *_strides(w2_scale, 3)[:2],
        ss2,
        _strides(shared_w2_scale, 2)[0],
        ws.part,
        ws.topk_w,
        ws.sorted_ids,
        ws.block_expert,
        ws.n_assign,
        ws.n_slots,
        H,
        I,
        S,
        e1 - e0,
        k_chunk,
        BLOCK_M=cfg.block_m,
        BN=cfg.bn2,
        BK=cfg.bk2,
        IEEE=ieee,
        SHARED=shared,
        FP8=fp8,
        STRADDLE=fp8 and shared and I % FP8_BLOCK.value != 0,
        num_warps=cfg.warps2,
        num_stages=cfg.stages2,
    )
    _combine(ws, out, top_k, e0, e1, split)


def _combine(ws, out, top_k, e0, e1, split):
    """Launch 4: out[t] = the sum of its slots' rows of part, routed then virtual, in that order."""
    T, H = out.shape
    # The combine's tile does not change any sum (each element adds its slots in slot order), so the
    # interpreter, where every program costs, takes big ones.
    bh = min(1024, max(16, _pow2(H)))
    tiles_h = triton.cdiv(H, bh)
    bt = 16 if _interpreted() else max(1, min(16, _pow2(T * tiles_h // TARGET_PROGRAMS + 1) // 2))
    _combine_kernel[(triton.cdiv(T, bt), tiles_h)](
        ws.part,
        ws.topk_ids,
        out,
        out.stride(0),
        out.stride(1),
        T,
        H,
        ws.n_assign,
        ws.n_slots,
        ws.n_virt,
        e0,
        e1,
        split,
        TOP_K=top_k,
        BT=bt,
        BH=bh,
        num_warps=4,
    )


def align_given(topk_ids, topk_weights, e0, e_loc, cfg, ws):
    """A given top-k into the workspace (ids outside the slice: -1), then the alignment's launch."""
    n = ws.topk_ids.numel()
    ws.topk_ids.copy_(given_topk(topk_ids, topk_weights, e0, e_loc)[0].view(n))
    ws.topk_w.copy_(topk_weights.reshape(n))
    _align_launch(ws, e0, e_loc, cfg)


def moe(
    hidden,
    router_weight,
    router_logits,
    w13,
    w2,
    expert_bias,
    out,
    *,
    top_k: int,
    renormalize: bool,
    scoring: str,
    num_groups: int,
    topk_groups: int,
    routed_scaling: float,
    expert_offset: int,
    topk_ids=None,
    topk_weights=None,
    shared_w13=None,
    shared_w2=None,
    w13_scale=None,
    w2_scale=None,
    shared_w13_scale=None,
    shared_w2_scale=None,
    config=None,
) -> None:
    """Writes out [T, H]; `config` (a MoeConfig or a dict of overrides) is for tests and tuning."""
    T, H = hidden.shape
    e_loc, two_i, _ = w13.shape
    I = two_i // 2
    if T == 0 or H == 0:
        return
    given = topk_ids is not None
    # The router's experts; a given top-k has none (its slice stands for them in the tile heuristics).
    E = e_loc if given else (router_weight.shape[0] if router_weight is not None else router_logits.shape[1])
    e0, e1 = expert_offset, expert_offset + e_loc
    n_virt = virtual_experts(I, shared_w13.shape[0] // 2 if shared_w13 is not None else 0)
    cfg = choose_config(T, top_k, E, e_loc, H, I, hidden.dtype, n_virt=n_virt, weight_dtype=w13.dtype)
    if isinstance(config, MoeConfig):
        cfg = config
    elif config:
        cfg = replace(cfg, **config)
    grouped = cfg.gemm == "grouped_mm"
    if grouped:
        if w13.dtype == FP8_DTYPE:
            raise ValueError(
                "config: gemm='grouped_mm' takes no FP8 weights (torch._grouped_mm has no block scales)"
            )
        cfg = replace(cfg, block_m=GROUPED_BLOCK_M, split_k=1)
    elif cfg.gemm != "triton":
        raise ValueError(f"config: gemm must be 'triton' or 'grouped_mm', got {cfg.gemm!r}")
    ws = Workspace(T, top_k, e_loc, I, H, hidden.dtype, hidden.device, cfg, distinct=not given, n_virt=n_virt)
    if given:
        align_given(topk_ids, topk_weights, e0, e_loc, cfg, ws)
    else:
        route_and_align(
            hidden,
            router_weight,
            router_logits,
            top_k,
            renormalize,
            scoring,
            expert_bias,
            num_groups,
            topk_groups,
            routed_scaling,
            e0,
            e1,
            E,
            cfg,
            ws,
        )
    if grouped:
        experts_grouped_mm(hidden, w13, w2, top_k, ws, shared_w13=shared_w13, shared_w2=shared_w2)
        _combine(ws, out, top_k, e0, e1, 1)
        return
    experts(
        hidden,
        w13,
        w2,
        top_k,
        e0,
        e1,
        out,
        cfg,
        ws,
        shared_w13=shared_w13,
        shared_w2=shared_w2,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        shared_w13_scale=shared_w13_scale,
        shared_w2_scale=shared_w2_scale,
    )
