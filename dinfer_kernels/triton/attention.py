"""Window attention with partial KV refresh and block sparsity in Triton.
Contract: dinfer_kernels/reference/attention.py; public op: dinfer_kernels/ops/attention.py.

Launches, all with grids fixed by the shapes (no host sync: CUDA-graph capturable):

1. `_refresh_kernel`, grid (B * W,): the window's fresh K/V rows go into the cache rows `positions`
   (valid rows only; padding rows, positions outside [0, min(seq_len, S)) and rows of absent pages
   are skipped). With write_back=False the W cache rows it overwrites are first saved to a
   [2, B, W, Hkv, D] buffer and put back by the same kernel (MODE 2) after the attention: O(W) copies,
   never a whole-cache copy.
2. `_attn_kernel`, grid (NQB * MT, B * Hkv, SPLITS): flash-attention forward. One program takes the
   query rows of one query block (or an M-tile of it, MT tiles per block) for all G = Hq / Hkv query
   heads of one kv head at once (GQA packing: packed row m = row r * G + head hh, so every K/V tile is
   loaded once for the G heads), walks its share of the block's key-block list (contiguous runs of
   list entries per split; no list = every block) in one flat loop over BLOCK_N-key tiles (a listed
   block's keys [blk * kv_block, min((blk + 1) * kv_block, seq_len))): S = Q K^T in fp32, online
   softmax in base 2, O += P V with P in the input dtype (fp32 accumulators; fp32 inputs use IEEE fp32
   dots). Out-of-range list entries and counts are clamped/skipped, so any values are safe to read.
   With a block table (PAGED) every key row is found through it (`_kv_rows`, per key: page
   s // page_size, row s % page_size); a key whose page id is outside the pool is masked like a key
   past seq_len and never loaded.
   With SPLITS == 1 its epilogue writes out (and lse); otherwise it writes the normalised partial O
   and partial lse of its split (fp32) and
3. `_combine_kernel`, grid (B * W, Hq), merges the SPLITS partials in split order (deterministic).
   SPLITS is fixed by the shapes: enough programs for ~TARGET_PROGRAMS when B * Hkv * NQB * MT is
   small (window steps), each split keeping at least MIN_TILES_PER_SPLIT key tiles.
4. block_mass (when wanted): the attention kernel stores, per valid row and listed block, the block's
   log-sum-exp log(sum_{s in blk} exp(scale q.k_s)) into an [B, Hq, W, NKB] fp32 buffer pre-filled
   with -inf; once the final lse is known, `_block_mass_kernel`, grid (B * Hq, ceil(NKB / 64)),
   sums exp(block_lse - lse) over the rows in row order (deterministic, exact in fp32).
"""

import torch
import triton
import triton.language as tl

# Dense key prefixes to torch's SDPA (dinfer_kernels/attention_sdpa.py): full refreshes and other calls of
# >= 1024 rows over >= 2048 keys that every row attends. Why: on the one H200 run (802ee3b) SDPA (cuDNN)
# took 992 us at W = S = 8192 against this backend's 1693 us; window steps (W ~ 96) stay ours (3.4x SDPA +
# merge at W 96, S 8192: no whole-cache copy, block lists). Retune from bench_attention's "ours" /
# "ours+sdpa" / "sdpa" refresh rows.
SDPA_DENSE = {"min_rows": 1024, "min_keys": 2048}

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
# Programs to aim for when splitting the key range: 2 per SM of an H200 (132 SMs). A constant, not the
# device's SM count, so that the split (hence the summation order, hence the bits) is the same on
# every device.
TARGET_PROGRAMS = 2 * 132
MIN_TILES_PER_SPLIT = 4
# What this backend takes (dinfer_kernels/_backend.py's supports hook): the head dims are the tiles'
# widths; a dense attn_mask only the torch reference takes.
SUPPORTS = {
    "q.dtype": (torch.float16, torch.bfloat16, torch.float32),
    "q.head_dim": (64, 128),
    "attn_mask": (None,),
}


@triton.jit
def _save_offsets(row, n_rows, Hkv, hd, d, D: tl.constexpr):
    """Offsets of row `row`'s heads hd, lanes d in the K half of the [2, n_rows, Hkv, D] contiguous save
    buffer, and the K-to-V distance. 64-bit before any product: n_rows * Hkv * D passes 2**31."""
    return (row.to(tl.int64) * Hkv + hd) * D + d, n_rows.to(tl.int64) * Hkv * D


@triton.jit
def _kv_rows(s, ok, b, block_table, MP, PS, NP, PAGED: tl.constexpr):
    """Where the cache rows of positions s (where ok) of sequence b are, as int64 indices into the
    cache's first two dims, and whether each is present: (b, s) for contiguous caches; with a block
    table (page block_table[b, s // PS], row s % PS) of the pool, absent when the page id is outside
    [0, NP) (then page 0, never used)."""
    if PAGED:
        j = s // PS
        page = tl.load(block_table + b.to(tl.int64) * MP + j, mask=ok, other=-1)
        present = ok & (page >= 0) & (page < NP)
        return tl.where(present, page, 0).to(tl.int64), (s - j * PS).to(tl.int64), present
    else:
        return tl.zeros_like(s).to(tl.int64) + b, s.to(tl.int64), ok


@triton.jit
def _refresh_kernel(
    k,
    v,
    k_cache,
    v_cache,
    save,
    positions,
    seq_lens,
    block_table,
    W,
    S,
    Hkv,
    MP,
    PS,
    NP,
    sk_b,
    sk_w,
    sk_h,
    sv_b,
    sv_w,
    sv_h,
    skc_0,
    skc_1,
    skc_h,
    svc_0,
    svc_1,
    svc_h,
    spos_b,
    spos_w,
    MODE: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
):
    """MODE 0: cache[pos] = fresh; 1: save = cache[pos], then cache[pos] = fresh; 2: cache[pos] = save."""
    row = tl.program_id(0)
    b = row // W
    w = row % W
    pos = tl.load(positions + b.to(tl.int64) * spos_b + w * spos_w)
    seq = tl.minimum(tl.maximum(tl.load(seq_lens + b), 0), S)
    # one comparison per scalar: the interpreter turns `scalar bool & tensor bool` into an int mask
    valid = tl.where(pos >= 0, pos, seq) < seq
    pos = tl.where(valid, pos, 0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    # the row as a one-element vector: the page lookup is a masked load
    pos_v = tl.zeros([1], tl.int64) + pos
    ok_v = (tl.zeros([1], tl.int32) + tl.where(valid, 1, 0)) != 0
    i0, i1, present = _kv_rows(pos_v, ok_v, b, block_table, MP, PS, NP, PAGED)
    hd = h[:, None]
    ok = (hd < tl.where(present[:, None], Hkv, 0)) & (d[None, :] < D)
    kc = k_cache + (i0 * skc_0 + i1 * skc_1)[:, None] + hd * skc_h + d[None, :]
    vc = v_cache + (i0 * svc_0 + i1 * svc_1)[:, None] + hd * svc_h + d[None, :]
    k_at, n_save = _save_offsets(row, tl.num_programs(0), Hkv, hd, d[None, :], D)
    sv = save + k_at
    if MODE == 2:
        tl.store(kc, tl.load(sv, mask=ok), mask=ok)
        tl.store(vc, tl.load(sv + n_save, mask=ok), mask=ok)
    else:
        if MODE == 1:
            tl.store(sv, tl.load(kc, mask=ok), mask=ok)
            tl.store(sv + n_save, tl.load(vc, mask=ok), mask=ok)
        kf = tl.load(k + b.to(tl.int64) * sk_b + w * sk_w + hd * sk_h + d[None, :], mask=ok)
        vf = tl.load(v + b.to(tl.int64) * sv_b + w * sv_w + hd * sv_h + d[None, :], mask=ok)
        tl.store(kc, kf, mask=ok)
        tl.store(vc, vf, mask=ok)


@triton.jit
def _attn_kernel(
    q,
    k_cache,
    v_cache,
    positions,
    seq_lens,
    block_table,
    kv_num_blocks,
    kv_indices,
    out,
    lse,
    o_part,
    lse_part,
    lm,
    B,
    W,
    S,
    Hq,
    Hkv,
    MP,
    PS,
    NP,
    MAXB,
    NKB,
    q_block,
    kv_block,
    n_mt,
    splits,
    scale_log2,
    sq_b,
    sq_w,
    sq_h,
    skc_0,
    skc_1,
    skc_h,
    svc_0,
    svc_1,
    svc_h,
    spos_b,
    spos_w,
    G: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
    SPLIT: tl.constexpr,
    WANT_LSE: tl.constexpr,
    WANT_MASS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    pid = tl.program_id(0)
    bg = tl.program_id(1)
    sp = tl.program_id(2)
    j = pid // n_mt
    mt = pid % n_mt
    b = bg // Hkv
    g = bg % Hkv
    ROWS: tl.constexpr = BLOCK_M // G

    m = tl.arange(0, BLOCK_M)
    r = mt * ROWS + m // G  # row inside the query block
    hh = m % G
    w = j * q_block + r
    h = g * G + hh
    row_ok = (m < ROWS * G) & (r < q_block) & (w < W)
    w = tl.where(row_ok, w, 0)
    seq = tl.minimum(tl.maximum(tl.load(seq_lens + b), 0), S)
    pos = tl.load(positions + b.to(tl.int64) * spos_b + w * spos_w, mask=row_ok, other=-1)
    row_valid = row_ok & (pos >= 0) & (pos < seq)

    d = tl.arange(0, D)
    q_ptr = q + b.to(tl.int64) * sq_b + w[:, None] * sq_w + h[:, None] * sq_h + d[None, :]
    q_tile = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
    kc = k_cache + g * skc_h
    vc = v_cache + g * svc_h

    if HAS_BLOCKS:
        cnt = tl.load(kv_num_blocks + bg * tl.cdiv(W, q_block) + j)
        cnt = tl.minimum(tl.maximum(cnt, 0), MAXB)
        idx_base = kv_indices + (bg * tl.cdiv(W, q_block) + j).to(tl.int64) * MAXB
    else:
        cnt = tl.cdiv(seq, kv_block)
    per = tl.cdiv(cnt, splits)
    e_lo = sp * per
    e_hi = tl.minimum(e_lo + per, cnt)
    if WANT_MASS:
        lm_row = ((b * Hq + h).to(tl.int64) * W + w) * NKB

    # One flat loop over the key tiles of this split's list entries (TPB tiles per key block), so the
    # loads of the next tiles are pipelined across key-block boundaries.
    TPB = tl.cdiv(kv_block, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    blk_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for t in range(e_lo * TPB, e_hi * TPB):
        e = t // TPB
        sub = t - e * TPB
        if HAS_BLOCKS:
            blk = tl.load(idx_base + e)
        else:
            blk = e
        blk_ok = tl.where(blk >= 0, blk, NKB) < NKB
        lo = tl.where(blk_ok, blk, 0) * kv_block
        hi = tl.where(blk_ok, tl.minimum(lo + kv_block, seq), lo)
        s = lo + sub * BLOCK_N + tl.arange(0, BLOCK_N)
        i0, i1, kmask = _kv_rows(s, s < hi, b, block_table, MP, PS, NP, PAGED)
        k_row = i0 * skc_0 + i1 * skc_1
        k_tile = tl.load(kc + k_row[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        qk = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PREC) * scale_log2
        qk = tl.where(kmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(qk - m_safe[:, None])
        p_sum = tl.sum(p, 1)
        l_i = l_i * alpha + p_sum
        v_tile = tl.load(vc + (i0 * svc_0 + i1 * svc_1)[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=DOT_PREC)
        m_i = m_new
        if WANT_MASS:
            # this block's sum of exp, relative to the running max; stored on its last tile as the
            # block's log-sum-exp (natural log)
            blk_sum = tl.where(sub == 0, 0.0, blk_sum * alpha) + p_sum
            blk_lse = tl.where(
                blk_sum != 0, (m_safe + tl.log2(tl.where(blk_sum != 0, blk_sum, 1.0))) * LN2, float("-inf")
            )
            blk_v = tl.zeros([BLOCK_M], tl.int32) + blk
            sub_v = tl.zeros([BLOCK_M], tl.int32) + sub
            last = row_valid & (blk_v >= 0) & (blk_v < NKB) & (sub_v == TPB - 1)
            tl.store(lm + lm_row + blk, blk_lse, mask=last)

    has = row_valid & (l_i != 0)  # != keeps a NaN sum (NaN / +inf score): non-finite propagates
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = tl.where(has, m_fin + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o = tl.where(has[:, None], o, 0.0)
    row_id = (b * W + w).to(tl.int64) * Hq + h  # (b, w, h) in [B, W, Hq]
    if SPLIT:
        part = sp.to(tl.int64) * B * W * Hq + row_id
        tl.store(o_part + part[:, None] * D + d[None, :], o, mask=row_ok[:, None])
        tl.store(lse_part + part, lse2, mask=row_ok)
    else:
        tl.store(out + row_id[:, None] * D + d[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None])
        if WANT_LSE:
            tl.store(lse + row_id, lse2 * LN2, mask=row_ok)


@triton.jit
def _combine_kernel(
    o_part, lse_part, out, lse, BWH, splits, WANT_LSE: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr
):
    row_id = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)  # (b, w, h)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    s_ok = sp < splits
    part = sp.to(tl.int64) * BWH + row_id
    ls = tl.load(lse_part + part, mask=s_ok, other=float("-inf"))
    mx = tl.max(ls, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wt = tl.exp2(ls - mx)
    total = tl.sum(wt, 0)
    o = tl.load(o_part + part[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    res = tl.sum(wt[:, None] * o, 0) / tl.where(total != 0, total, 1.0)
    tl.store(out + row_id * D + d, res.to(out.dtype.element_ty))
    if WANT_LSE:
        tl.store(
            lse + row_id,
            tl.where(total != 0, (mx + tl.log2(tl.where(total != 0, total, 1.0))) * LN2, float("-inf")),
        )


@triton.jit
def _block_mass_kernel(lm, lse, mass, W, Hq, NKB, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // Hq
    h = bh % Hq
    kb = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kb_ok = kb < NKB
    acc = tl.zeros([BLOCK_K], tl.float32)
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        w_ok = w < W
        row_lse = tl.load(lse + (b * W + w).to(tl.int64) * Hq + h, mask=w_ok, other=float("-inf"))
        ok = w_ok[:, None] & kb_ok[None, :]
        blk = tl.load(
            lm + (bh.to(tl.int64) * W + w[:, None]) * NKB + kb[None, :], mask=ok, other=float("-inf")
        )
        live = ok & (blk != float("-inf")) & (row_lse[:, None] != float("-inf"))  # NaN stays live
        diff = tl.where(live, blk, 0.0) - tl.where(live, row_lse[:, None], 0.0)
        acc += tl.sum(tl.where(live, tl.exp(diff), 0.0), 0)
    tl.store(mass + bh.to(tl.int64) * NKB + kb, acc, mask=kb_ok)


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(1, x))


def plan(
    B: int,
    W: int,
    S: int,
    Hq: int,
    Hkv: int,
    D: int,
    dtype,
    has_blocks: bool,
    q_block: int,
    kv_block: int,
    max_blocks: int,
    want_mass: bool,
) -> dict:
    """Tile sizes, key-block size and split count: a function of the shapes only."""
    G = Hq // Hkv
    fp32 = dtype == torch.float32
    if not has_blocks:
        q_block = max(W, 1)
    rows = min(q_block, max(W, 1))
    m_cap = 64 if fp32 else 128
    block_m = max(16, min(m_cap, _pow2(rows * G)), _pow2(G))
    rows_per_tile = block_m // G
    n_mt = triton.cdiv(rows, rows_per_tile)
    nqb = triton.cdiv(max(W, 1), q_block)
    n_cap = 32 if fp32 else 64
    if has_blocks or want_mass:
        kvb = kv_block
        block_n = max(16, min(n_cap, _pow2(kvb)))
        entries = max_blocks if has_blocks else triton.cdiv(S, kvb)
    else:
        block_n = n_cap
        kvb = block_n
        entries = triton.cdiv(S, kvb)
    tiles = entries * triton.cdiv(kvb, block_n)
    base = B * Hkv * nqb * n_mt
    splits = 1
    if base < TARGET_PROGRAMS and entries > 1:
        splits = min(triton.cdiv(TARGET_PROGRAMS, base), triton.cdiv(tiles, MIN_TILES_PER_SPLIT), entries)
        splits = max(1, splits)
        # equal runs of entries per split: drop splits that would get no entry
        splits = triton.cdiv(entries, triton.cdiv(entries, splits))
    num_warps = 8 if block_m >= 128 else 4
    return dict(
        G=G,
        q_block=q_block,
        block_m=block_m,
        n_mt=n_mt,
        nqb=nqb,
        block_n=block_n,
        kvb=kvb,
        nkb=triton.cdiv(S, kvb),
        splits=splits,
        num_warps=num_warps,
        num_stages=2 if W > 256 else 3,
    )


def attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions,
    seq_lens,
    block_table,
    kv_num_blocks,
    kv_indices,
    out,
    lse,
    block_mass,
    *,
    write_back: bool,
    q_block: int,
    kv_block: int,
    scale: float,
) -> None:
    B, W, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    paged = block_table is not None
    # the paged layout's geometry: positions S = MP * page_size over a pool of NP pages
    MP, PS, NP = (block_table.shape[1], k_cache.shape[1], k_cache.shape[0]) if paged else (0, 1, 0)
    S = MP * PS if paged else k_cache.shape[1]
    dev = q.device
    if B * W * Hq == 0:
        if block_mass is not None:
            block_mass.zero_()
        return
    has_blocks = kv_num_blocks is not None
    want_mass = block_mass is not None
    maxb = kv_indices.shape[-1] if has_blocks else 0
    cfg = plan(B, W, S, Hq, Hkv, D, q.dtype, has_blocks, q_block, kv_block, maxb, want_mass)
    seq_lens = seq_lens.contiguous()
    if has_blocks:
        kv_num_blocks = kv_num_blocks.contiguous()
        kv_indices = kv_indices.contiguous() if maxb else torch.zeros(1, dtype=torch.int32, device=dev)
    else:
        kv_num_blocks = kv_indices = seq_lens  # never read
    table = block_table.contiguous() if paged else seq_lens  # never read without PAGED
    block_h = _pow2(Hkv)

    def refresh(mode, save):
        _refresh_kernel[(B * W,)](
            k,
            v,
            k_cache,
            v_cache,
            save,
            positions,
            seq_lens,
            table,
            W,
            S,
            Hkv,
            MP,
            PS,
            NP,
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            positions.stride(0),
            positions.stride(1),
            MODE=mode,
            PAGED=paged,
            BLOCK_H=block_h,
            D=D,
            num_warps=4,
        )

    if write_back:
        save = k_cache  # never read
        refresh(0, save)
    else:
        save = torch.empty((2, B, W, Hkv, D), dtype=k_cache.dtype, device=dev)
        refresh(1, save)

    splits = cfg["splits"]
    nkb = cfg["nkb"]
    want_lse = lse is not None
    lse_buf = (
        lse if want_lse else (torch.empty((B, W, Hq), dtype=torch.float32, device=dev) if want_mass else None)
    )
    lm = torch.full((B, Hq, W, nkb), float("-inf"), dtype=torch.float32, device=dev) if want_mass else out
    if splits > 1:
        o_part = torch.empty((splits, B, W, Hq, D), dtype=torch.float32, device=dev)
        lse_part = torch.empty((splits, B, W, Hq), dtype=torch.float32, device=dev)
    else:
        o_part = lse_part = out  # never read
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (cfg["nqb"] * cfg["n_mt"], B * Hkv, splits)
    _attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        positions,
        seq_lens,
        table,
        kv_num_blocks,
        kv_indices,
        out,
        lse_buf if lse_buf is not None else out,
        o_part,
        lse_part,
        lm,
        B,
        W,
        S,
        Hq,
        Hkv,
        MP,
        PS,
        NP,
        maxb,
        nkb,
        cfg["q_block"],
        cfg["kvb"],
        cfg["n_mt"],
        splits,
        float(scale) * LOG2E,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        positions.stride(0),
        positions.stride(1),
        G=cfg["G"],
        PAGED=paged,
        HAS_BLOCKS=has_blocks,
        SPLIT=splits > 1,
        WANT_LSE=lse_buf is not None,
        WANT_MASS=want_mass,
        DOT_PREC=dot_prec,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        D=D,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if splits > 1:
        _combine_kernel[(B * W, Hq)](
            o_part,
            lse_part,
            out,
            lse_buf if lse_buf is not None else out,
            B * W * Hq,
            splits,
            WANT_LSE=lse_buf is not None,
            BLOCK_S=_pow2(splits),
            D=D,
            num_warps=4,
        )
    if want_mass and nkb > 0:
        _block_mass_kernel[(B * Hq, triton.cdiv(nkb, 64))](
            lm, lse_buf, block_mass, W, Hq, nkb, BLOCK_W=32, BLOCK_K=64, num_warps=4
        )
    if not write_back:
        refresh(2, save)
