"""Window attention over a per-layer KV cache with partial refresh — the spec.

A diffusion step recomputes Q/K/V for a window of rows at absolute positions; those rows attend
bidirectionally to the whole valid sequence: cached keys outside the window, fresh keys inside it.

q           [B, W, Hq, D]   window queries (QK-norm and RoPE already applied at each row's position)
k, v        [B, W, Hkv, D]  the window's fresh keys/values; Hq is a multiple of Hkv (GQA: query head h
                            reads kv head h // (Hq / Hkv))
k_cache,
v_cache     [B, S, Hkv, D]  the layer's cache (same dtype as q)
positions   [B, W] int64    absolute position of each window row in [0, S). Valid rows have distinct
                            positions, and no padding row shares a valid row's position. A row with
                            position >= seq_lens[b] is padding: it is never written, its output is 0.
seq_lens    [B] int32       keys [0, seq_lens[b]) are attended; padding keys never are.
write_back  bool            True: the fresh k/v of valid rows are written into the cache in place
                            (rows positions[b, w]); no other cache row changes. False: the cache is
                            left untouched, the window's keys are substituted for this call only
                            (dInfer's vicinity refresh). The output is the same either way.
attn_mask   [B, W, S] bool or None: True where a query row may attend a key (block-causal, ...).
scale       softmax scale, default 1 / sqrt(D).

out[b, w, h] = sum_s softmax_s(scale * q . key_s) * value_s over attended keys s; rows with no
attended key give 0. Math in fp32, result in q's dtype, shape [B, W, Hq, D].
"""
import math

import torch


def attention_reference(q, k, v, k_cache, v_cache, positions, seq_lens, write_back=True,
                        attn_mask=None, scale=None, compute_dtype=torch.float32):
    B, W, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    lens = seq_lens.to(torch.int64)
    row_valid = positions < lens[:, None]
    if write_back:
        keys, values = k_cache, v_cache
    else:
        keys, values = k_cache.clone(), v_cache.clone()
    # Padding rows write back what their position already holds: fixed shapes, no host sync, so the
    # op can sit inside a CUDA graph.
    idx = positions[:, :, None, None].expand(B, W, Hkv, D)
    keep = row_valid[:, :, None, None]
    keys.scatter_(1, idx, torch.where(keep, k, keys.gather(1, idx)))
    values.scatter_(1, idx, torch.where(keep, v, values.gather(1, idx)))

    group = Hq // Hkv
    kf = keys.to(compute_dtype).repeat_interleave(group, dim=2)      # [B, S, Hq, D]
    vf = values.to(compute_dtype).repeat_interleave(group, dim=2)
    scores = torch.einsum("bwhd,bshd->bhws", q.to(compute_dtype), kf) * scale
    key_valid = torch.arange(S, device=q.device)[None, :] < lens[:, None]            # [B, S]
    vf = vf.masked_fill(~key_valid[:, :, None, None], 0.0)  # garbage in padding rows must not leak
    allowed = key_valid[:, None, None, :]
    if attn_mask is not None:
        allowed = allowed & attn_mask[:, None, :, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)                 # rows with no key: 0
    out = torch.einsum("bhws,bshd->bwhd", probs, vf)
    out = out * row_valid[:, :, None, None]
    return out.to(q.dtype if compute_dtype == torch.float32 else compute_dtype).contiguous()
