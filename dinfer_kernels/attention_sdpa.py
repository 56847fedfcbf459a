"""Dense tiles of dinfer_kernels.attention delegated to torch's fused SDPA kernels.

A full refresh (W = S, every key attended) is dense attention: torch's cuDNN / flash kernels are
faster there than ours (H200, W = S = 8192: SDPA 992 us, triton 1693 us, cuda 2193 us), so a kernel
backend may hand the dense part of a call to them. The call is split by keys: the key prefix
[0, P) that every valid row attends (whole key blocks listed for every batch, kv head and query block,
and below every sequence's length) goes to SDPA over strided views of the refreshed cache; the
listed key blocks past P go to the backend's own kernel with a block mask of those blocks only; the
two (out, lse) pairs are merged by their log-sum-exps. Padding rows are zeroed afterwards.

When: `delegate()` is called by the op for the kernel backends, and declines (the backend's own
kernel then runs the whole call) unless
  - the switch allows it: mode "auto" (default) asks the backend module's SDPA_DENSE rule
    ({"min_rows", "min_keys"}, or None: never), "always" delegates whatever the shapes and backend
    (tests, on the host), "off" never (the benchmark's "ours" rows);
  - no block_mass is wanted (its per-block statistics are not in SDPA's output), the caches are
    contiguous (no block table), and no CUDA graph is being captured (the prefix P is read on the
    host: one small device-to-host copy, outside capture only);
  - in fp16 / bf16, nothing is left for the rest (SDPA's output comes rounded to the input dtype, and
    a merge would round it twice where the contract rounds once): the full refresh; in fp32 any
    dense prefix;
  - an SDPA kernel that returns the log-sum-exp takes the inputs (feature-detected, never raised).
The op never sees attn_mask on a kernel backend (only the torch reference takes one).

last_backend() names the SDPA kernel the latest delegated call ran (the benchmark's rows print it).
"""

import contextlib
from typing import Optional

import torch

from .block_mask import cdiv
from .reference.attention import block_mask_dense

MODES = ("auto", "always", "off")
_state = {"mode": "auto", "last": None}


@contextlib.contextmanager
def mode(value: str):
    """Within the block, delegation follows `value`: "auto" (the backend's rule), "always" or "off"."""
    if value not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {value!r}")
    before = _state["mode"]
    _state["mode"] = value
    try:
        yield
    finally:
        _state["mode"] = before


def last_backend(clear: bool = False) -> Optional[str]:
    """The aten op the latest delegated call ran (e.g. "_scaled_dot_product_cudnn_attention"), or None
    (none since the last clear=True)."""
    name = _state["last"]
    if clear:
        _state["last"] = None
    return name


def _sdpa_ops(device_type: str):
    """The aten SDPA kernels that return the log-sum-exp, best first, as (name, call(q, k, v, scale) ->
    (out [B, H, L, D], lse [B, H, >= L] natural log)), the ones this torch has."""
    aten = torch.ops.aten
    if device_type == "cpu":
        names = [("_scaled_dot_product_flash_attention_for_cpu", lambda f, q, k, v, s: f(q, k, v, scale=s))]
    else:
        names = [
            ("_scaled_dot_product_cudnn_attention", lambda f, q, k, v, s: f(q, k, v, None, True, scale=s)),
            ("_scaled_dot_product_flash_attention", lambda f, q, k, v, s: f(q, k, v, scale=s)),
            (
                "_scaled_dot_product_efficient_attention",
                lambda f, q, k, v, s: f(q, k, v, None, True, scale=s),
            ),
        ]
    return [(name, getattr(aten, name), call) for name, call in names if hasattr(aten, name)]


def sdpa_with_lse(q, k, v, scale: float):
    """(out [B, Hq, L, D], lse [B, Hq, L] fp32, the op's name) for q [B, Hq, L, D] over k, v
    [B, Hkv, S, D] (GQA: head h reads kv head h // (Hq / Hkv)), or None when no kernel takes them.
    GQA is tried natively first (flash takes it), then through expanded copies of k and v."""
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    variants = [(k, v)]
    if Hkv != Hq:
        g = Hq // Hkv
        expand = lambda t: t[:, :, None].expand(B, Hkv, g, *t.shape[2:]).reshape(B, Hq, *t.shape[2:])
        variants.append((expand(k), expand(v)))
    for kk, vv in variants:  # every kernel natively before any on copies
        for name, fn, call in _sdpa_ops(q.device.type):
            try:
                res = call(fn, q, kk, vv, scale)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):  # refused: the next one
                continue
            out, lse = res[0], res[1]
            if out.shape != q.shape:
                continue
            # cuDNN gives [B, H, L, 1], efficient attention pads L to a multiple of 32
            return out, lse.reshape(B, Hq, -1)[..., :L].float(), name
    return None


def merge(out_a, lse_a, out_b, lse_b):
    """The attention over two disjoint key sets from each one's (out, lse): weights exp(lse - max)."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # both -inf: no key, out stays 0
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    norm = torch.where(total > 0, total, torch.ones_like(total))
    out = (out_a.float() * wa[..., None] + out_b.float() * wb[..., None]) / norm[..., None]
    return out, m + torch.log(total)


def _wanted(backend_module, W: int, dense_keys: int) -> bool:
    if _state["mode"] == "always":
        return dense_keys > 0
    rule = getattr(backend_module, "SDPA_DENSE", None)
    return (
        _state["mode"] == "auto"
        and rule is not None
        and W >= rule["min_rows"]
        and dense_keys >= rule["min_keys"]
    )


def delegate(
    backend_module,
    impl,
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
) -> bool:
    """Run the call as dense SDPA + the backend's kernel `impl` on the rest, writing out (and lse);
    False (nothing written, the cache untouched) when it declines (module docstring)."""
    if _state["mode"] == "off" or block_mass is not None or block_table is not None:
        return False
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    B, W, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    if B * W * Hq * S == 0:
        return False
    if not _wanted(backend_module, W, S):  # dense_keys <= S: window steps stop here, with no sync
        return False
    nkb = cdiv(S, kv_block)
    dev = q.device
    lens = seq_lens.to(torch.int64).clamp(0, S)
    row_valid = (positions >= 0) & (positions < lens[:, None])
    # The dense prefix: whole key blocks every list holds, cut to the shortest sequence (on the device,
    # then one small copy to the host).
    if kv_num_blocks is not None:
        common = block_mask_dense(kv_num_blocks, kv_indices, nkb).flatten(0, 2).all(0)  # [NKB]
        prefix_blocks = common.to(torch.int64).cumprod(0).sum()
    else:
        prefix_blocks = torch.tensor(nkb, device=dev)
    dense_keys = torch.clamp(prefix_blocks * kv_block, max=S)
    min_len = lens.min()
    dense_keys = torch.where(min_len < dense_keys, min_len // kv_block * kv_block, dense_keys)
    dense_blocks = torch.where(dense_keys == S, nkb, dense_keys // kv_block)
    rest = _rest_blocks(kv_num_blocks, kv_indices, B, Hkv, nkb, dense_blocks, dev)
    flags = [dense_keys, dense_blocks, row_valid.all(), (rest[0] > 0).any()]
    host = torch.stack([t.to(torch.int64) for t in flags]).tolist()
    dense_keys, dense_blocks, all_valid, has_rest = host
    # SDPA's output comes rounded to the input dtype: merged with a rest it would be rounded twice,
    # where the contract rounds once. So in fp16 / bf16 only calls without a rest are delegated.
    if has_rest and q.dtype != torch.float32:
        return False
    if not _wanted(backend_module, W, dense_keys):
        return False

    # Refresh the window rows in place (padding rows rewrite what they read: fixed shapes), saving the
    # rows it overwrites when the caller keeps its cache.
    idx = positions.clamp(0, S - 1)[:, :, None, None].expand(B, W, Hkv, D)
    keep = row_valid[:, :, None, None]
    saved = [c.gather(1, idx) for c in (k_cache, v_cache)]
    for cache, fresh, old in zip((k_cache, v_cache), (k, v), saved):
        cache.scatter_(1, idx, torch.where(keep, fresh, old))

    def restore():
        if not write_back:
            for cache, old in zip((k_cache, v_cache), saved):
                cache.scatter_(1, idx, old)

    views = [c[:, :dense_keys].transpose(1, 2) for c in (k_cache, v_cache)]  # [B, Hkv, P, D]
    res = sdpa_with_lse(q.transpose(1, 2), views[0], views[1], scale)
    if res is None:
        restore()
        return False
    o, o_lse, name = res
    _state["last"] = name
    o, o_lse = o.transpose(1, 2), o_lse.transpose(1, 2)  # [B, W, Hq, D], [B, W, Hq]
    # an lse of +inf comes only from a +inf score (the max is subtracted first): the contract's NaN
    o_lse = torch.where(o_lse == float("inf"), float("nan"), o_lse)

    if has_rest:
        counts, indices = rest
        rq_block = q_block if kv_num_blocks is not None else max(W, 1)
        r_out = torch.empty_like(out)
        r_lse = torch.empty((B, W, Hq), dtype=torch.float32, device=dev)
        impl(
            q=q,
            k=k,
            v=v,
            k_cache=k_cache,
            v_cache=v_cache,
            positions=positions,
            seq_lens=seq_lens,
            block_table=None,
            kv_num_blocks=counts,
            kv_indices=indices,
            out=r_out,
            lse=r_lse,
            block_mass=None,
            write_back=True,  # already refreshed: rewrites the same rows
            q_block=rq_block,
            kv_block=kv_block,
            scale=scale,
        )
        o, o_lse = merge(o, o_lse, r_out, r_lse)
    if not all_valid:
        o = torch.where(row_valid[:, :, None, None], o, torch.zeros((), dtype=o.dtype, device=dev))
        o_lse = torch.where(row_valid[:, :, None], o_lse, torch.full((), float("-inf"), device=dev))
    out.copy_(o)
    if lse is not None:
        lse.copy_(o_lse)
    restore()
    return True


def _rest_blocks(kv_num_blocks, kv_indices, B, Hkv, nkb, dense_blocks, dev):
    """(kv_num_blocks, kv_indices) listing only the key blocks >= dense_blocks (a device scalar) of each
    list; with no block mask, every key block in one query block (q_block = W)."""
    if kv_num_blocks is None:
        kv_indices = torch.arange(nkb, dtype=torch.int32, device=dev).expand(B, Hkv, 1, nkb)
        kv_num_blocks = torch.full((B, Hkv, 1), nkb, dtype=torch.int32, device=dev)
    maxb = kv_indices.shape[-1]
    listed = torch.arange(maxb, device=dev) < kv_num_blocks[..., None].to(torch.int64)
    idx = kv_indices.to(torch.int64)
    rest = listed & (idx >= dense_blocks) & (idx < nkb)
    # kept entries first, in their order (a stable sort on "dropped")
    order = torch.sort((~rest).to(torch.int8), dim=-1, stable=True).indices
    indices = kv_indices.gather(-1, order).contiguous()
    return rest.sum(-1).to(torch.int32).contiguous(), indices
