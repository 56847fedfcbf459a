"""Window attention over a per-layer KV cache with partial refresh and block sparsity — the spec.

A diffusion step recomputes Q/K/V for a window of rows at absolute positions; those rows attend
bidirectionally to the whole valid sequence: cached keys outside the window, fresh keys inside it.

q           [B, W, Hq, D]   window queries (QK-norm and RoPE already applied at each row's position)
k, v        [B, W, Hkv, D]  the window's fresh keys/values; Hq is a multiple of Hkv (GQA: query head h
                            reads kv head h // (Hq / Hkv))
k_cache,
v_cache     [B, S, Hkv, D]  the layer's cache (same dtype as q), or with block_table a page pool
                            [P, page_size, Hkv, D] that every sequence of the call shares (below)
block_table [B, MP] int32 or None: the paged layout (vLLM style). Sequence b's position s lives in
            page block_table[b, s // page_size] at row s % page_size, so S = MP * page_size takes
            the place of the cache length everywhere (positions, seq_lens, key blocks, block_mass).
            Unchecked page ids (the op checks them on host tensors only) never reach outside the
            pool: a position whose page id is outside [0, P) is absent -- never attended (even where
            a window row sits), never written. The pool row of a valid window row is the row of no
            other position below seq_lens of the call, in its own sequence or another, with or
            without write_back (the GPU kernels write window rows into the pool for the call and
            restore them): valid window rows land on distinct pool rows, and pages may be shared
            between sequences only where no window row of the call sits (prefix sharing).
positions   [B, W] int64    absolute position of each window row in [0, S). Valid rows have distinct
                            positions, and no padding row shares a valid row's position. A row with
                            position >= seq_lens[b] is padding: it is never written, its output is 0.
seq_lens    [B] int32       keys [0, seq_lens[b]) are attended; padding keys never are.
write_back  bool            True: the fresh k/v of valid rows are written into the cache in place
                            (rows positions[b, w]); no other cache row changes. False: the cache is
                            left untouched, the window's keys are substituted for this call only
                            (dInfer's vicinity refresh). The output is the same either way.
attn_mask   [B, W, S] bool or None: True where a query row may attend a key (block-causal, ...).
block_mask  (kv_num_blocks, kv_indices, q_block, kv_block) or None (dinfer_kernels.BlockMask):
            kv_num_blocks [B, Hkv, NQB] int32, kv_indices [B, Hkv, NQB, MAXB] int32. Window row w is
            in query block w // q_block (NQB = ceil(W / q_block)); key s is in key block s // kv_block
            (NKB = ceil(S / kv_block)). The query heads of kv head g in query block j attend only the
            keys of the blocks kv_indices[b, g, j, :kv_num_blocks[b, g, j]]; entries past the count are
            ignored, listed indices are distinct and in [0, NKB) (here: any other value is skipped).
            Combined with seq_lens and attn_mask by AND.
scale       softmax scale, default 1 / sqrt(D).

out[b, w, h] = sum_s softmax_s(scale * q . key_s) * value_s over attended keys s; rows with no
attended key give 0. Math in fp32, result in q's dtype, shape [B, W, Hq, D].

Non-finite inputs propagate, never turn into finite output: a valid row whose query or attended keys
give a NaN or +inf score (softmax undefined) gets out all NaN, lse NaN, and NaN in the block_mass of
each block it attends; an attended NaN or +-inf value makes that output column non-finite. Only
what a row does not read (keys past seq_lens, unlisted blocks, masked keys, padding rows) is ignored,
whatever it holds.

Optional statistics (fp32, or compute_dtype):
lse        [B, W, Hq]  log(sum over attended keys s of exp(scale * q . key_s)), natural log; -inf for
                       rows with no attended key and for padding rows.
block_mass [B, Hq, NKB] (needs block_mask for the key-block size) for each key block, the softmax
                       probability mass it received, summed over the valid window rows. Summed over
                       the blocks it gives the number of valid rows that attend at least one key.

Returns out, or (out, lse?, block_mass?) with only the requested extras, in that order.
Everything here has shapes fixed by the inputs (no data-dependent shapes), so it can run under
CUDA-graph capture.
"""

import math

import torch


def block_mask_dense(kv_num_blocks, kv_indices, num_key_blocks: int):
    """[B, Hkv, NQB, NKB] bool: which key blocks each (batch, kv head, query block) lists.
    Entries past the count, negative or >= num_key_blocks are ignored (no data-dependent shapes)."""
    B, Hkv, NQB, MAXB = kv_indices.shape
    listed = torch.arange(MAXB, device=kv_indices.device) < kv_num_blocks[..., None].to(torch.int64)
    idx = kv_indices.to(torch.int64)
    ok = listed & (idx >= 0) & (idx < num_key_blocks)
    target = torch.where(ok, idx, torch.full_like(idx, num_key_blocks))
    dense = torch.zeros(B, Hkv, NQB, num_key_blocks + 1, dtype=torch.bool, device=kv_indices.device)
    dense.scatter_(-1, target, torch.ones_like(target, dtype=torch.bool))
    return dense[..., :num_key_blocks]


def paged_rows(block_table, num_pages: int, page_size: int):
    """([B, S] int64 flat pool row of each position, [B, S] bool whether its page id is in
    [0, num_pages)) for S = MP * page_size; absent positions point at row 0 (never read as keys)."""
    B, MP = block_table.shape
    pages = block_table.to(torch.int64).repeat_interleave(page_size, dim=1)  # [B, S]
    present = (pages >= 0) & (pages < num_pages)
    offset = torch.arange(MP * page_size, device=block_table.device) % page_size
    return torch.where(present, pages * page_size + offset, torch.zeros_like(pages)), present


def _gather(pool, rows):
    """[*rows.shape, Hkv, D]: the pool rows `rows` (flat row r = page r // page_size, row
    r % page_size), indexed per dimension: any pool strides, no copy of the pool."""
    ps = pool.shape[1]
    return pool[rows // ps, rows % ps]


def _write_pages(k_pool, v_pool, k, v, rows, write):
    """Window rows `write` [B, W] of k / v [B, W, Hkv, D] into flat pool rows `rows` [B, W], in
    place (any pool strides). Fixed shapes and no host sync (capturable): every other row repeats the
    first written row's copy (or, with none written, rewrites one row with what it holds), so
    duplicate indices always carry equal values and the result does not depend on the order of the
    copies."""
    r, w = rows.flatten(), write.flatten()
    if r.numel() == 0:
        return
    first = torch.argmax(w.to(torch.int32))  # 0 when nothing is written
    target = torch.where(w, r, r[first])
    ps = k_pool.shape[1]
    for pool, fresh in ((k_pool, k), (v_pool, v)):
        src = fresh.flatten(0, 1)
        fill = torch.where(w[first], src[first], _gather(pool, r[first]))
        pool.index_put_((target // ps, target % ps), torch.where(w[:, None, None], src, fill))


def attention_reference(
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions,
    seq_lens,
    write_back=True,
    attn_mask=None,
    scale=None,
    compute_dtype=torch.float32,
    *,
    block_mask=None,
    return_lse=False,
    return_block_mass=False,
    block_table=None,
):
    B, W, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    S = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if return_block_mass and block_mask is None:
        raise ValueError(
            "block_mask: return_block_mass needs a block mask (its kv_block sets the "
            "key blocks; BlockMask.full(...) for dense attention)"
        )
    lens = seq_lens.to(torch.int64)
    row_valid = positions < lens[:, None]
    key_present = torch.ones(B, S, dtype=torch.bool, device=q.device)
    if block_table is not None:
        page_rows, key_present = paged_rows(block_table, k_cache.shape[0], k_cache.shape[1])
        keys, values = _gather(k_cache, page_rows), _gather(v_cache, page_rows)
    elif write_back:
        keys, values = k_cache, v_cache
    else:
        keys, values = k_cache.clone(), v_cache.clone()
    # Padding rows write back what their position already holds: fixed shapes, no host sync, so the
    # op can sit inside a CUDA graph.
    idx = positions[:, :, None, None].expand(B, W, Hkv, D)
    keep = row_valid[:, :, None, None]
    keys.scatter_(1, idx, torch.where(keep, k, keys.gather(1, idx)))
    values.scatter_(1, idx, torch.where(keep, v, values.gather(1, idx)))
    if block_table is not None and write_back:
        _write_pages(
            k_cache,
            v_cache,
            k,
            v,
            page_rows.gather(1, positions),
            row_valid & key_present.gather(1, positions),
        )

    group = Hq // Hkv
    kf = keys.to(compute_dtype).repeat_interleave(group, dim=2)  # [B, S, Hq, D]
    vf = values.to(compute_dtype).repeat_interleave(group, dim=2)
    scores = torch.einsum("bwhd,bshd->bhws", q.to(compute_dtype), kf) * scale
    key_valid = (torch.arange(S, device=q.device)[None, :] < lens[:, None]) & key_present  # [B, S]
    vf = vf.masked_fill(~key_valid[:, :, None, None], 0.0)  # garbage in padding rows must not leak
    allowed = key_valid[:, None, None, :] & row_valid[:, None, :, None]  # [B, 1, W, S]
    if attn_mask is not None:
        allowed = allowed & attn_mask[:, None, :, :]
    if block_mask is not None:
        kv_num_blocks, kv_indices, q_block, kv_block = block_mask
        nkb = -(-S // kv_block)
        dense = block_mask_dense(kv_num_blocks, kv_indices, nkb)  # [B, Hkv, NQB, NKB]
        qb = torch.arange(W, device=q.device) // q_block
        kb = torch.arange(S, device=q.device) // kv_block
        per_key = dense[:, :, qb][:, :, :, kb]  # [B, Hkv, W, S]
        allowed = allowed & per_key.repeat_interleave(group, dim=1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    # 0 for keys not attended and rows with no key (softmax gives NaN there); a NaN or +inf score
    # keeps the row's NaN (non-finite inputs propagate)
    probs = torch.where(allowed, torch.softmax(scores, -1), 0.0)
    # Non-finite values: in the einsum a key a row does not attend would give 0 * inf = NaN, so they
    # enter as zeros there and are added back per row as IEEE sums would give them (counted by dense
    # einsums, no data-dependent shapes: the op stays capturable). A term p * x with x = +-inf is
    # +-inf where p > 0 and NaN where p is 0 or NaN; x = NaN gives NaN.
    bad = ~vf.isfinite()
    out = torch.einsum("bhws,bshd->bwhd", probs, vf.masked_fill(bad, 0.0))
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or bad.any():
        attended = allowed.expand(B, Hq, W, S)
        hit = attended & (probs > 0)
        count = lambda rows, keys: torch.einsum("bhws,bshd->bwhd", rows.float(), keys.float())
        nan = count(attended, vf.isnan()) + count(attended & ~hit, vf.isinf())
        pos, neg = count(hit, vf.isposinf()), count(hit, vf.isneginf())
        inf = torch.full_like(out, float("inf"))  # made on the device: no host copy under capture
        extra = torch.where((nan > 0) | ((pos > 0) & (neg > 0)), inf - inf, torch.where(pos > 0, inf, -inf))
        out = torch.where((nan > 0) | (pos > 0) | (neg > 0), out + extra, out)
    out = out * row_valid[:, :, None, None]
    out = out.to(q.dtype if compute_dtype == torch.float32 else compute_dtype).contiguous()
    if not (return_lse or return_block_mass):
        return out
    stat_dtype = torch.float32 if compute_dtype in (torch.float16, torch.bfloat16) else compute_dtype
    result = (out,)
    if return_lse:
        undefined = (scores.isnan() | (scores == float("inf"))).any(-1)  # logsumexp would say +inf
        lse = torch.logsumexp(scores, -1).masked_fill(undefined, float("nan"))
        result += (lse.transpose(1, 2).to(stat_dtype).contiguous(),)
    if return_block_mass:
        kv_block = block_mask[3]
        nkb = -(-S // kv_block)
        per_key = probs.sum(2)  # [B, Hq, S]
        per_key = torch.nn.functional.pad(per_key, (0, nkb * kv_block - S))
        result += (per_key.view(B, Hq, nkb, kv_block).sum(-1).to(stat_dtype).contiguous(),)
    return result
