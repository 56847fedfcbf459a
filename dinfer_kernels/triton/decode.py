"""Fused decode step in Triton. Contract: dinfer_kernels/reference/decode.py.

Two launches, both with grids fixed by the shapes (CUDA-graph capturable, no host sync):

1. `_partials_kernel`, grid (N, S): program (n, s) streams vocabulary chunk s of row n once, in
   BLOCK_V-wide tiles, and keeps over the tokens v != mask_id of the chunk the raw max / argmax /
   sum of exp(z - max) and, when sampling, the best score z/T + gumbel and its index. The mask token
   is left out so that the fallback (best non-mask token) comes for free; the finalize step folds the
   mask token back in. S = min(ceil(V / BLOCK_V), ceil(528 / N)) (528 = 4 programs per SM of an
   H200), rounded so that every chunk is a whole number of tiles: 32-96 rows still give ~500
   programs, and each streams >= BLOCK_V = 2048 logits.
2. `_finalize_kernel`, grid (B,): one program per sequence walks its rows in chunks of BLOCK_R and
   (A) merges the S partials of each row, folds in the mask token, updates the credit slots, applies
   the credit to max / sum / argmax in O(K) and writes candidate, confidence, nonfinite;
   (B) after a CTA barrier, applies the commit rule and the progress guarantee and writes commit and
   tokens. Per-row values that (B) reads across rows go through a small scratch area. The joint
   rule's edits need nothing across rows: (A) decides them and parks them in `commit`, (B) adds them.

Workspace (one fp32 allocation, also viewed as int32), with P = N * S:
  [0, P)      fp32  max of z over the chunk (v != mask_id)
  [P, 2P)     fp32  sum of exp(z - max) over the chunk
  [2P, 3P)    fp32  best score z/T + gumbel over the chunk (sampling only)
  [3P, 4P)    int32 argmax of z (lowest index on ties)
  [4P, 5P)    int32 argmax of the score (sampling only)
  [5P, 6P)    int32 1 if a raw logit of the chunk is NaN or +-inf (sanitising hides it), else 0
  then 4 row fields of N each: c (confidence if eligible, else -inf), fallback confidence (-inf if
  none or not masked), fallback token (int32; the default token if none), segment id (hierarchical: masked runs share one).
Entry (n, s) of a partial field sits at n * S + s.
"""

import torch
import triton
import triton.language as tl

from ..reference import rng

FLT_MAX = tl.constexpr(3.4028234663852886e38)
INT_MAX = tl.constexpr(2147483647)
AT_LEAST_ONE_EPS = tl.constexpr(1e-5)
PARTIAL_FIELDS = tl.constexpr(6)
ROW_FIELDS = 4
# 4 programs per SM of an H200 (132 SMs); a constant, not the device's count, so that the split (and
# hence the summation order, i.e. the bits of the confidences) is the same on every device.
TARGET_PROGRAMS = 4 * 132


@triton.jit
def _sanitise(z):
    """NaN -> -inf, +inf -> FLT_MAX (step 0 of the contract); z is fp32."""
    z = tl.where(z != z, float("-inf"), z)
    return tl.minimum(z, FLT_MAX)


@triton.jit
def _online_softmax(m, total, z):
    """One step of a per-lane running (max, sum of exp(z - max)), with one exp per element:
    exp(-|z - m|) is the rescale of the sum when z is a new max and the addend otherwise."""
    m_new = tl.maximum(m, z)
    e = tl.exp(tl.minimum(m, z) - tl.where(m_new == float("-inf"), 0.0, m_new))
    return m_new, tl.where(z > m, total * e + 1.0, total + e)


@triton.jit
def _merge_lanes(m, total):
    """(max, sum of exp(z - max)) of a row from its per-lane running values."""
    m_all = tl.max(m, 0)
    return m_all, tl.sum(total * tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all)), 0)


@triton.jit
def _mix32(x):
    """reference/rng.py mix32 on uint32 values (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel(row_key, v):
    """-log(-log(u)) with u from the counter hash of (row key, token v), as reference/rng.py."""
    h = _mix32(row_key ^ v.to(tl.uint32))
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _row_keys(key, rows):
    """mix(mix(mix(seed ^ GOLDEN) ^ offset) ^ row), given key = the two inner mixes."""
    return _mix32(key.to(tl.uint32, bitcast=True) ^ rows.to(tl.uint32))


@triton.jit
def _row_counters(row_keys, rows, ok, HAS_KEYS: tl.constexpr):
    """The hash's row counters: the caller's keys (low 32 bits) or the row indices."""
    if HAS_KEYS:
        return tl.load(row_keys + rows, mask=ok, other=0).to(tl.uint32)
    else:
        return rows


@triton.jit
def _score(z, row_key, v, temperature, SAMPLE: tl.constexpr):
    """z (argmax decoding) or z / T + gumbel (sampling); an IEEE division, as the contract's z'/T."""
    if SAMPLE:
        return tl.math.div_rn(z, temperature) + _gumbel(row_key, v)
    else:
        return z


@triton.jit
def _pick(val_a, idx_a, val_b, idx_b):
    """The better of two (value, index) candidates: larger value, lower index on ties."""
    b_wins = (val_b > val_a) | ((val_b == val_a) & (idx_b < idx_a))
    return tl.where(b_wins, val_b, val_a), tl.where(b_wins, idx_b, idx_a)


@triton.jit
def _best(vals, ids, ok):
    """Per row of a 2-D tile: max of vals over `ok` and the lowest id holding it."""
    vals = tl.where(ok, vals, float("-inf"))
    best = tl.max(vals, 1)
    return best, tl.min(tl.where(ok & (vals == best[:, None]), ids, INT_MAX), 1)


@triton.jit(do_not_specialize=["mask_id", "key"])
def _partials_kernel(
    logits,
    stride_n,
    ws,
    ws_i,
    row_keys,
    N,
    V,
    S,
    CHUNK,
    mask_id,
    temperature,
    key,
    SAMPLE: tl.constexpr,
    HAS_KEYS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    n = tl.program_id(0)
    s = tl.program_id(1)
    lo = s * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    row = logits + n.to(tl.int64) * stride_n
    row_key = _row_keys(key, _row_counters(row_keys, n, n < N, HAS_KEYS))

    # Per-lane running state, merged once after the loop: no cross-thread reduction per tile.
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_V], tl.float32)
    arg = tl.zeros([BLOCK_V], tl.int32)
    bad = tl.zeros([BLOCK_V], tl.int32)
    if SAMPLE:
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_arg = tl.zeros([BLOCK_V], tl.int32)
    for start in range(lo, hi, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        z = tl.load(row + v, mask=v < hi, other=float("-inf")).to(tl.float32)
        bad = tl.maximum(bad, ((v < hi) & ~(tl.abs(z) <= FLT_MAX)).to(tl.int32))  # NaN or +-inf
        z = tl.where(v == mask_id, float("-inf"), _sanitise(z))
        # A strict '>' keeps each lane's first (lowest) index.
        arg = tl.where(z > m, v, arg)
        m, total = _online_softmax(m, total, z)
        if SAMPLE:
            g = _score(z, row_key, v, temperature, SAMPLE)
            best_arg = tl.where(g > best, v, best_arg)
            best = tl.maximum(best, g)

    P = N * S
    at = n * S + s
    m_all, total = _merge_lanes(m, total)
    tl.store(ws + at, m_all)
    tl.store(ws + P + at, total)
    tl.store(ws_i + 3 * P + at, tl.min(tl.where(m == m_all, arg, INT_MAX), 0))
    tl.store(ws_i + 5 * P + at, tl.max(bad, 0))
    if SAMPLE:
        best_all = tl.max(best, 0)
        tl.store(ws + 2 * P + at, best_all)
        tl.store(ws_i + 4 * P + at, tl.min(tl.where(best == best_all, best_arg, INT_MAX), 0))


@triton.jit
def _logit_at(row_ptr, idx, ok):
    """Sanitised z[idx] per row (-inf where not ok)."""
    return _sanitise(tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32))


@triton.jit
def _credit_at(ids, vals, credited, idx):
    """alpha-free credit term log1p(C[idx]) per row (0 for an uncredited token)."""
    return tl.log(1.0 + tl.sum(tl.where(credited & (ids == idx[:, None]), vals, 0.0), 1))


@triton.jit
def _beaten_in_run(c_ws, seg_ws, rows, c, lo, hi, BLOCK_R: tl.constexpr):
    """Per row: does a row of the same masked run hold a larger c? (pairwise over the sequence)"""
    seg = tl.load(seg_ws + rows, mask=rows < hi, other=-1)
    beaten = tl.zeros([BLOCK_R], tl.int32)
    for j0 in range(lo, hi, BLOCK_R):
        rows_j = j0 + tl.arange(0, BLOCK_R)
        c_j = tl.load(c_ws + rows_j, mask=rows_j < hi, other=float("-inf"))
        seg_j = tl.load(seg_ws + rows_j, mask=rows_j < hi, other=-2)
        hit = (seg_j[None, :] == seg[:, None]) & (c_j[None, :] > c[:, None])
        beaten = tl.maximum(beaten, tl.max(hit.to(tl.int32), 1))
    return beaten > 0


@triton.jit
def _rank(c_ws, rows, c, lo, hi, BLOCK_R: tl.constexpr):
    """Per row: number of rows of the sequence ahead of it (larger c, or equal c and lower row)."""
    rank = tl.zeros([BLOCK_R], tl.int32)
    for j0 in range(lo, hi, BLOCK_R):
        rows_j = j0 + tl.arange(0, BLOCK_R)
        live_j = rows_j < hi
        c_j = tl.load(c_ws + rows_j, mask=live_j, other=float("-inf"))
        tie = (c_j[None, :] == c[:, None]) & (rows_j[None, :] < rows[:, None])
        ahead = (c_j[None, :] > c[:, None]) | tie
        rank += tl.sum((ahead & live_j[None, :]).to(tl.int32), 1)
    return rank


@triton.jit(do_not_specialize=["mask_id", "key"])
def _finalize_kernel(
    logits,
    stride_n,
    tokens,
    seq_offsets,
    threshold,
    num_commit,
    credit_ids,
    credit_vals,
    ws,
    ws_i,
    row_keys,
    editable,
    candidate,
    confidence,
    commit,
    nonfinite,
    N,
    V,
    S,
    K,
    mask_id,
    low_threshold,
    temperature,
    key,
    alpha,
    beta,
    gamma,
    edit_threshold,
    RULE: tl.constexpr,
    SAMPLE: tl.constexpr,
    HAS_CREDIT: tl.constexpr,
    HAS_KEYS: tl.constexpr,
    HAS_EDITABLE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    # Unchecked offsets (values are not validated on a GPU) must not reach past the rows: clamped to
    # [0, N] with hi >= lo, as the CUDA and host kernels do.
    lo = tl.minimum(tl.maximum(tl.load(seq_offsets + b), 0), N)
    hi = tl.minimum(tl.maximum(tl.load(seq_offsets + b + 1), lo), N)
    P = N * S
    c_ws = ws + PARTIAL_FIELDS * P  # row scratch, see the module docstring
    fbc_ws = c_ws + N
    fb_ws = ws_i + PARTIAL_FIELDS * P + 2 * N
    seg_ws = fb_ws + N
    sp = tl.arange(0, BLOCK_S)

    # Sequence-wide facts gathered in phase A for phase B (typed: the loop may not run).
    c_max = tl.full([], float("-inf"), tl.float32)  # max c and the first row holding it
    c_row = lo
    fb_max = tl.full([], float("-inf"), tl.float32)  # best fallback confidence of masked rows
    fb_row = lo
    first_masked = tl.full([], INT_MAX, tl.int32)  # the default-token row of step 5
    any_masked = tl.zeros([], tl.int32)
    any_eligible = tl.zeros([], tl.int32)
    seg_base = tl.zeros([], tl.int32)

    # ---- phase A: per-row statistics, credit, candidate, confidence, fallback -------------------
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        live = rows < hi
        row_ptr = logits + rows.to(tl.int64) * stride_n
        row_key = _row_keys(key, _row_counters(row_keys, rows, live, HAS_KEYS))
        tok = tl.load(tokens + rows, mask=live, other=0)
        masked = live & (tok == mask_id)

        # Merge the chunk partials; chunks are in index order, so the lowest index wins ties.
        at = rows[:, None] * S + sp[None, :]
        ok = live[:, None] & (sp[None, :] < S)
        part_m = tl.load(ws + at, mask=ok, other=float("-inf"))
        part_s = tl.load(ws + P + at, mask=ok, other=0.0)
        m_nm, a_nm = _best(part_m, tl.load(ws_i + 3 * P + at, mask=ok, other=INT_MAX), ok)
        m_nm_safe = tl.where(m_nm == float("-inf"), 0.0, m_nm)
        s_nm = tl.sum(part_s * tl.exp(part_m - m_nm_safe[:, None]), 1)
        bad = tl.max(tl.load(ws_i + 5 * P + at, mask=ok, other=0), 1)
        tl.store(nonfinite + rows, bad > 0, mask=live)
        if SAMPLE:
            g_nm, gi_nm = _best(
                tl.load(ws + 2 * P + at, mask=ok, other=float("-inf")),
                tl.load(ws_i + 4 * P + at, mask=ok, other=INT_MAX),
                ok,
            )
        else:
            g_nm = m_nm
            gi_nm = a_nm

        # Fold the mask token back in: raw max m, argmax top1, sum of exp(z - m) (step 1).
        z_mask = _sanitise(tl.load(row_ptr + mask_id, mask=live, other=float("-inf")).to(tl.float32))
        m, top1 = _pick(m_nm, a_nm, z_mask, mask_id)
        dead = m == float("-inf")
        m_safe = tl.where(dead, 0.0, m)
        total = s_nm * tl.exp(m_nm - m_safe) + tl.exp(z_mask - m_safe)
        g_all, gi_all = _pick(g_nm, gi_nm, _score(z_mask, row_key, mask_id, temperature, SAMPLE), mask_id)

        if HAS_CREDIT:
            # Step 2: decay, then credit p* ** gamma to the raw top-1 of masked live rows: its own
            # slot, else the first empty one, else the smallest (lowest slot on ties).
            ks = tl.arange(0, BLOCK_K)
            kat = rows[:, None] * K + ks[None, :]
            kok = live[:, None] & (ks[None, :] < K)
            ids = tl.load(credit_ids + kat, mask=kok, other=-1)
            vals = tl.load(credit_vals + kat, mask=kok, other=0.0)
            # Unchecked ids outside [0, V) would index past the row: they become empty slots, as in
            # decode_math.h's finalize_row.
            bad = (ids < 0) | (ids >= V)
            ids = tl.where(bad, -1, ids)
            vals = tl.where(bad, 0.0, vals) * beta
            boost = tl.exp(gamma * tl.log(tl.math.div_rn(1.0, total)))  # (p* = 1 / s) ** gamma
            hit = ids == top1[:, None]
            hit_slot = tl.min(tl.where(hit, ks[None, :], BLOCK_K), 1)
            empty_slot = tl.min(tl.where(kok & (ids < 0), ks[None, :], BLOCK_K), 1)
            v_min = tl.min(tl.where(kok, vals, float("inf")), 1)
            min_slot = tl.min(tl.where(kok & (vals == v_min[:, None]), ks[None, :], BLOCK_K), 1)
            slot = tl.where(
                hit_slot < BLOCK_K, hit_slot, tl.where(empty_slot < BLOCK_K, empty_slot, min_slot)
            )
            upd = (masked & ~dead)[:, None] & (ks[None, :] == slot[:, None])
            vals = tl.where(upd, tl.where(hit, vals, 0.0) + boost[:, None], vals)
            ids = tl.where(upd, top1[:, None], ids)
            tl.store(credit_ids + kat, ids, mask=kok)
            tl.store(credit_vals + kat, vals, mask=kok)

            # Step 3 in O(K): credit only raises logits, so the fused max is max(m, credited z') and
            # the sum changes by exp(z'_j) - exp(z_j) for each credited j.
            credited = kok & (ids >= 0)
            z_c = _logit_at(row_ptr[:, None], ids, credited)
            zf_c = z_c + alpha * tl.log(1.0 + vals)
            mf = tl.maximum(m, tl.max(tl.where(credited, zf_c, float("-inf")), 1))
            mf_safe = tl.where(mf == float("-inf"), 0.0, mf)
            corr = tl.where(credited, tl.exp(zf_c - mf_safe[:, None]) - tl.exp(z_c - mf_safe[:, None]), 0.0)
            total_f = total * tl.exp(m_safe - mf_safe) + tl.sum(corr, 1)
            # A credited token's fused score is >= its raw one (also after rounding), so merging the
            # raw best with the best credited fused score gives the fused best, ties included.
            sc = _score(zf_c, row_key[:, None], ids, temperature, SAMPLE)
            g_c, gi_c = _best(sc, ids, credited)
            g_all, gi_all = _pick(g_all, gi_all, g_c, gi_c)
            g_c, gi_c = _best(sc, ids, credited & (ids != mask_id))
            g_nm, gi_nm = _pick(g_nm, gi_nm, g_c, gi_c)
        else:
            mf_safe = m_safe
            total_f = total

        # Candidate and confidence = softmax(z')[candidate]; fallback = best non-mask fused score,
        # invalid when that is -inf (dead rows, V == 1).
        cand = tl.where(dead, mask_id, gi_all)
        fb_ok = masked & (g_nm > float("-inf"))
        z_cand = _logit_at(row_ptr, cand, live & ~dead)
        z_fb = _logit_at(row_ptr, gi_nm, fb_ok)
        if HAS_CREDIT:
            z_cand = z_cand + alpha * _credit_at(ids, vals, credited, cand)
            z_fb = z_fb + alpha * _credit_at(ids, vals, credited, gi_nm)
        # Probabilities are exp(z' - max) / sum: near FLT_MAX, max + log(sum) cannot be formed.
        conf = tl.where(dead, 0.0, tl.math.div_rn(tl.exp(z_cand - mf_safe), total_f))
        fb_conf = tl.where(fb_ok, tl.math.div_rn(tl.exp(z_fb - mf_safe), total_f), float("-inf"))
        tl.store(candidate + rows, cand.to(tl.int64), mask=live)
        tl.store(confidence + rows, conf, mask=live)

        eligible = masked & (cand != mask_id)
        if RULE == 3:
            # Token-to-token edits (decode_math.h row_edits): committed rows whose candidate is neither
            # the mask (so live) nor their token, above edit_threshold; parked in `commit` for (B).
            edit = live & ~masked & (cand != mask_id) & (cand != tok) & (conf > edit_threshold)
            if HAS_EDITABLE:
                edit = edit & (tl.load(editable + rows, mask=live, other=0) != 0)
            tl.store(commit + rows, edit, mask=live)
        c = tl.where(eligible, conf, float("-inf"))
        tl.store(c_ws + rows, c, mask=live)
        tl.store(fbc_ws + rows, fb_conf, mask=live)
        tl.store(fb_ws + rows, tl.where(fb_ok, gi_nm, tl.where(mask_id == 0, 1, 0)), mask=live)
        if RULE == 1:
            # Segment ids: a maximal run of masked rows shares one; every unmasked row is its own.
            prev = tl.load(tokens + rows - 1, mask=live & (rows > lo), other=-1)
            starts = (~(masked & (prev == mask_id))).to(tl.int32)
            tl.store(seg_ws + rows, seg_base + tl.cumsum(starts, 0), mask=live)
            seg_base += tl.sum(starts, 0)

        chunk_max, chunk_arg = tl.max(c, 0, return_indices=True)
        c_row = tl.where(chunk_max > c_max, r0 + chunk_arg, c_row)
        c_max = tl.maximum(c_max, chunk_max)
        chunk_max, chunk_arg = tl.max(fb_conf, 0, return_indices=True)
        fb_row = tl.where(chunk_max > fb_max, r0 + chunk_arg, fb_row)
        fb_max = tl.maximum(fb_max, chunk_max)
        first_masked = tl.minimum(first_masked, tl.min(tl.where(masked, rows, INT_MAX), 0))
        any_masked = tl.maximum(any_masked, tl.max(masked.to(tl.int32), 0))
        any_eligible = tl.maximum(any_eligible, tl.max(eligible.to(tl.int32), 0))

    # Phase B reads what other threads of this program wrote in phase A.
    tl.debug_barrier()

    # ---- phase B: commit rule, progress guarantee, token write ----------------------------------
    tau = tl.load(threshold + b)
    k = tl.load(num_commit + b)
    cut = tl.minimum(tau, c_max - AT_LEAST_ONE_EPS)
    # Step 5: masked rows but none eligible -> the best fallback commits (no rule commits then),
    # else (no fallback anywhere) the lowest masked row commits the default token, if V > 1.
    has_fb = fb_max > float("-inf")
    rescue = (any_masked > 0) & (any_eligible == 0) & (has_fb | (V > 1))
    rescue_row = tl.where(rescue, tl.where(has_fb, fb_row, first_masked), -1)
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        live = rows < hi
        c = tl.load(c_ws + rows, mask=live, other=float("-inf"))
        eligible = c > float("-inf")
        if RULE == 0 or RULE == 3:
            take = eligible & (c >= cut)
        elif RULE == 1:
            beaten = _beaten_in_run(c_ws, seg_ws, rows, c, lo, hi, BLOCK_R)
            take = eligible & ((~beaten & (c > low_threshold)) | (c > tau) | (rows == c_row))
        else:
            take = eligible & (_rank(c_ws, rows, c, lo, hi, BLOCK_R) < k)

        is_fb = live & (rows == rescue_row)
        take = take | is_fb
        if RULE == 3:
            take = take | (tl.load(commit + rows, mask=live, other=0) != 0)
        fb = tl.load(fb_ws + rows, mask=is_fb, other=0).to(tl.int64)
        tl.store(candidate + rows, fb, mask=is_fb)
        tl.store(
            confidence + rows, tl.maximum(tl.load(fbc_ws + rows, mask=is_fb, other=0.0), 0.0), mask=is_fb
        )
        new_tok = tl.where(is_fb, fb, tl.load(candidate + rows, mask=take & ~is_fb, other=0))
        tl.store(tokens + rows, new_tok, mask=take)
        tl.store(commit + rows, take, mask=live)


def _split(N: int, V: int, block_v: int):
    """(num_splits, chunk): ~TARGET_PROGRAMS programs in all, whole tiles per chunk."""
    splits = min(triton.cdiv(V, block_v), triton.cdiv(TARGET_PROGRAMS, max(N, 1)))
    chunk = triton.cdiv(triton.cdiv(V, splits), block_v) * block_v
    return triton.cdiv(V, chunk), chunk


def _int32(x: int) -> int:
    """A uint32 value as the int32 with the same bits (kernel arguments are signed)."""
    return x - (1 << 32) if x >= (1 << 31) else x


def decode_step(
    logits, tokens, seq_offsets, credit_ids, credit_vals, candidate, confidence, commit, nonfinite, params
) -> None:
    N, V = logits.shape
    B = seq_offsets.numel() - 1
    if N == 0:
        return
    K = credit_ids.shape[1]
    rule, sampling, credit, edit = params.rule, params.sampling, params.credit, params.edit
    sample = sampling.temperature > 0
    # 8 logits per thread and tile (one or two 16-byte loads), 256 threads.
    block_v = min(2048, max(16, triton.next_power_of_2(V)))
    S, chunk = _split(N, V, block_v)
    ws = torch.empty(PARTIAL_FIELDS.value * N * S + ROW_FIELDS * N, dtype=torch.float32, device=logits.device)
    ws_i = ws.view(torch.int32)
    key = _int32(rng.mix32(rng.mix32(sampling.seed ^ rng.GOLDEN) ^ sampling.offset))
    has_keys = sampling.row_keys is not None
    keys = sampling.row_keys if has_keys else tokens  # any int64 pointer when unused

    _partials_kernel[(N, S)](
        logits,
        logits.stride(0),
        ws,
        ws_i,
        keys,
        N,
        V,
        S,
        chunk,
        params.mask_id,
        float(sampling.temperature),
        key,
        SAMPLE=sample,
        HAS_KEYS=has_keys,
        BLOCK_V=block_v,
        num_warps=max(1, block_v // 256),
    )

    block_s = triton.next_power_of_2(S)
    block_k = max(2, triton.next_power_of_2(K))
    block_r = max(2, min(64, triton.next_power_of_2(N), 4096 // max(block_s, block_k)))
    _finalize_kernel[(B,)](
        logits,
        logits.stride(0),
        tokens,
        seq_offsets,
        rule.threshold,
        rule.num_commit,
        credit_ids,
        credit_vals,
        ws,
        ws_i,
        keys,
        tokens if edit.editable is None else edit.editable,  # any pointer when unused
        candidate,
        confidence,
        commit,
        nonfinite,
        N,
        V,
        S,
        K,
        params.mask_id,
        float(rule.low_threshold),
        float(sampling.temperature),
        key,
        float(credit.alpha),
        float(credit.beta),
        float(credit.gamma),
        float(edit.kernel_threshold),
        RULE=rule.code,
        SAMPLE=sample,
        HAS_CREDIT=K > 0,
        HAS_KEYS=has_keys,
        HAS_EDITABLE=edit.editable is not None,
        BLOCK_R=block_r,
        BLOCK_S=block_s,
        BLOCK_K=block_k,
        num_warps=4,
    )
