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
2. `_gemm1_kernel`, grid (P_MAX / BLOCK_M, cdiv(I, BN1)): the block's rows of hidden (gathered by
   token) times the gate *and* the up rows of its expert's w13 (two accumulators), SiLU(g) * u in
   fp32 in the epilogue, rounded to the dtype, written to act [P_MAX, I] at the block's rows (the
   padding rows get 0). Blocks of no expert return at once.
3. `_gemm2_kernel`, grid (P_MAX / BLOCK_M, cdiv(H, BN2), SPLIT_K): act times the expert's w2 over a
   K range, times the routing weight, fp32, written to the slot's row of part [SPLIT_K, T*k, H].
4. `_combine_kernel`, grid (cdiv(T, BT), cdiv(H, BH)): out[t] = sum over slots j (then splits s) in
   that fixed order of part[s, t*k + j], for the slots whose expert is local; no atomics, so the
   result is bit-identical run to run.

Tiles are chosen from the shapes only (`choose_config`): about k*T / experts rows per expert pick
BLOCK_M in {16, 32, 64, 128}; at 16-32 rows (the diffusion window, ~12 rows per expert) the GEMMs
stream weights: narrow N tiles so that all (expert, N tile) programs give >= 2 per SM of an H200, and
a K split of GEMM 2 when that is not enough (one token, a few experts).
"""

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .._moe_layout import given_topk

# Programs wanted per launch: 2 per SM of an H200 (132 SMs). A constant, so tiles (and the summation
# order of the split-K combine) do not depend on the device.
TARGET_PROGRAMS = 2 * 132
RENORM_EPS = tl.constexpr(1e-20)
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


def _interpreted():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(x):
    return triton.next_power_of_2(max(1, int(x)))


def _stages(per_stage_bytes, most=4):
    return max(2, min(most, SMEM_BUDGET // max(1, per_stage_bytes)))


def choose_config(T, top_k, E, e_loc, H, I, dtype) -> MoeConfig:
    """Tiles from the shapes alone (deterministic; the same on every device)."""
    item = torch.empty((), dtype=dtype).element_size()
    k_eff = min(top_k, e_loc)
    n = max(1, T * k_eff)
    touched = max(1, min(e_loc, n))
    rows = n / touched  # mean rows per touched expert
    block_m = min(128, max(16, _pow2(rows)))
    bk = 128 if item == 2 else 64
    if block_m <= 32:  # weight streaming: many narrow programs
        bn1 = next((b for b in (64, 32) if touched * triton.cdiv(I, b) >= TARGET_PROGRAMS), 16)
        bn2 = next((b for b in (64, 32) if touched * triton.cdiv(H, b) >= TARGET_PROGRAMS), 32)
        progs = touched * triton.cdiv(H, bn2)
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
    stages1 = _stages((block_m + 2 * bn1) * bk1 * item)
    stages2 = _stages((block_m + bn2) * bk2 * item)
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


def buffer_sizes(T, top_k, e_loc, block_m, distinct=True):
    """(P_MAX rows of the padded permuted list, number of BLOCK_M blocks) for the worst case;
    distinct: a token's experts are distinct (a router's are; a given top-k's need not be)."""
    k_eff = min(top_k, e_loc) if distinct else top_k
    n = T * k_eff
    touched = min(e_loc, n)
    p_max = n + touched * (block_m - 1)
    if distinct:
        p_max = min(p_max, e_loc * triton.cdiv(T, block_m) * block_m)
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
    n_assign,
    e0,
    e_loc,
    nb_max,
    BLOCK_M: tl.constexpr,
    EL_PAD: tl.constexpr,
    CH: tl.constexpr,
    NBC: tl.constexpr,
):
    """Counts, padded offsets, the permuted slot list and the block -> expert map (one program)."""
    el = tl.arange(0, EL_PAD)
    elm = el < e_loc
    counts = tl.zeros([EL_PAD], tl.int32)
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
    r = tl.arange(0, BLOCK_M)
    pad_pos = (starts + counts)[:, None] + r[None, :]
    tl.store(sorted_ids + pad_pos, n_assign, mask=elm[:, None] & (pad_pos < ends[:, None]))
    block_end = ends // BLOCK_M
    n_blocks = total // BLOCK_M
    for b0 in range(0, nb_max, NBC):
        b = b0 + tl.arange(0, NBC)
        local = tl.sum(((block_end[None, :] <= b[:, None]) & elm[None, :]).to(tl.int32), 1)
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
                T * TOP_K,
                e0,
                e_loc,
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
    n_assign,
    e0,
    e_loc,
    nb_max,
    BLOCK_M: tl.constexpr,
    EL_PAD: tl.constexpr,
    CH: tl.constexpr,
    NBC: tl.constexpr,
):
    _align(topk_ids, sorted_ids, block_expert, meta, n_assign, e0, e_loc, nb_max, BLOCK_M, EL_PAD, CH, NBC)


# -------------------------------------------------------------------------------------------- GEMMs
@triton.jit
def _gemm1_kernel(
    hidden,
    s_ht,
    s_hh,
    w13,
    s_we,
    s_wn,
    s_wk,
    act,
    sorted_ids,
    block_expert,
    n_assign,
    H,
    I,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if e < 0:
        return
    p = b * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids + p)
    valid = slot < n_assign
    tok = (slot // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < I
    w_gate = w13 + e.to(tl.int64) * s_we + cols[:, None].to(tl.int64) * s_wn
    w_up = w_gate + I * s_wn
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
    part,
    topk_w,
    sorted_ids,
    block_expert,
    n_assign,
    H,
    I,
    K_CHUNK,
    BLOCK_M: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert + b)
    if e < 0:
        return
    s = tl.program_id(2)
    p = b * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ids + p)
    valid = slot < n_assign
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cm = cols < H
    w_rows = w2 + e.to(tl.int64) * s_we + cols[:, None].to(tl.int64) * s_wn
    a_rows = act + p.to(tl.int64)[:, None] * I
    lo = s * K_CHUNK
    hi = tl.minimum(lo + K_CHUNK, I)
    acc = tl.zeros([BLOCK_M, BN], tl.float32)
    for k0 in range(lo, hi, BK):
        kk = k0 + tl.arange(0, BK)
        km = kk < hi
        a = tl.load(a_rows + kk[None, :], mask=km[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :] * s_wk, mask=cm[:, None] & km[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    weight = tl.load(topk_w + slot, mask=valid, other=0.0)
    acc = acc * weight[:, None]
    at = (s * n_assign + slot).to(tl.int64)[:, None] * H + cols[None, :]
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
    e0,
    e1,
    S,
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
        for s in range(S):
            at = (s * n_assign + slot).to(tl.int64)[:, None] * H + cols[None, :]
            acc += tl.load(part + at, mask=ok[:, None] & cm[None, :], other=0.0)
    o = out + rows.to(tl.int64)[:, None] * s_ot + cols[None, :] * s_oh
    tl.store(o, acc.to(out.dtype.element_ty), mask=live[:, None] & cm[None, :])


# ------------------------------------------------------------------------------------------ driver
class Workspace:
    """The device buffers of one call (exposed for tests and the benchmark's plain-GEMM baseline)."""

    def __init__(self, T, top_k, e_loc, I, H, dtype, device, cfg, distinct=True):
        self.p_max, self.nb_max = buffer_sizes(T, top_k, e_loc, cfg.block_m, distinct)
        n = T * top_k
        self.meta = torch.zeros(2, dtype=torch.int32, device=device)  # [ticket, padded rows]
        self.topk_ids = torch.empty(n, dtype=torch.int32, device=device)
        self.topk_w = torch.empty(n, dtype=torch.float32, device=device)
        self.sorted_ids = torch.empty(self.p_max, dtype=torch.int32, device=device)
        self.block_expert = torch.empty(self.nb_max, dtype=torch.int32, device=device)
        self.act = torch.empty((self.p_max, I), dtype=dtype, device=device)
        self.part = torch.empty((cfg.split_k, n, H), dtype=torch.float32, device=device)


def _align_args(e_loc, cfg):
    """The alignment's tile constants (_align, fused in the route kernel or its own launch) for a
    slice of e_loc local experts."""
    el_pad = max(16, _pow2(e_loc))
    return dict(
        BLOCK_M=cfg.block_m,
        EL_PAD=el_pad,
        CH=max(16, ALIGN_TILE // el_pad),
        NBC=max(16, ALIGN_TILE // el_pad),
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
    align_args = _align_args(e_loc, cfg)
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
        **align_args,
        num_warps=4 if e_pad <= 64 else 8,
    )
    if not cfg.one_launch:
        _align_kernel[(1,)](
            ws.topk_ids,
            ws.sorted_ids,
            ws.block_expert,
            ws.meta,
            T * top_k,
            e0,
            e_loc,
            ws.nb_max,
            **align_args,
            num_warps=4,
        )


def experts(hidden, w13, w2, top_k, e0, e1, out, cfg, ws):
    """Launches 2-4: GEMM 1 (+SiLU*mul), GEMM 2 (+routing weight), the ordered combine."""
    T, H = hidden.shape
    I = w13.shape[1] // 2
    n = T * top_k
    ieee = hidden.dtype == torch.float32
    _gemm1_kernel[(ws.nb_max, triton.cdiv(I, cfg.bn1))](
        hidden,
        hidden.stride(0),
        hidden.stride(1),
        w13,
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        ws.act,
        ws.sorted_ids,
        ws.block_expert,
        n,
        H,
        I,
        TOP_K=top_k,
        BLOCK_M=cfg.block_m,
        BN=cfg.bn1,
        BK=cfg.bk1,
        IEEE=ieee,
        num_warps=cfg.warps1,
        num_stages=cfg.stages1,
    )
    k_chunk = triton.cdiv(triton.cdiv(I, cfg.split_k), cfg.bk2) * cfg.bk2
    split = triton.cdiv(I, k_chunk)
    assert split <= cfg.split_k
    _gemm2_kernel[(ws.nb_max, triton.cdiv(H, cfg.bn2), split)](
        ws.act,
        w2,
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        ws.part,
        ws.topk_w,
        ws.sorted_ids,
        ws.block_expert,
        n,
        H,
        I,
        k_chunk,
        BLOCK_M=cfg.block_m,
        BN=cfg.bn2,
        BK=cfg.bk2,
        IEEE=ieee,
        num_warps=cfg.warps2,
        num_stages=cfg.stages2,
    )
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
        n,
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
    _align_kernel[(1,)](
        ws.topk_ids,
        ws.sorted_ids,
        ws.block_expert,
        ws.meta,
        n,
        e0,
        e_loc,
        ws.nb_max,
        **_align_args(e_loc, cfg),
        num_warps=4,
    )


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
    cfg = choose_config(T, top_k, E, e_loc, H, I, hidden.dtype)
    if isinstance(config, MoeConfig):
        cfg = config
    elif config:
        cfg = replace(cfg, **config)
    ws = Workspace(T, top_k, e_loc, I, H, hidden.dtype, hidden.device, cfg, distinct=not given)
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
    experts(hidden, w13, w2, top_k, e0, e1, out, cfg, ws)
