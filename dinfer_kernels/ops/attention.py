"""dinfer_kernels.attention, the torch.library op `dinfer::attention`: window queries attending
bidirectionally over a per-layer KV cache whose window rows are refreshed (in place with
write_back=True), optionally restricted to listed key blocks (BlockMask) and returning the
log-sum-exp and the per-key-block attention mass. Contract: dinfer_kernels/reference/attention.py.

Backends: torch (the reference; the only one that takes a dense attn_mask), triton and cuda (D in
{64, 128}; cuda: fp16/bf16) and cpu (host arrays, any D, fp32/fp16/bf16). backend="auto" (as every
op's, dinfer_kernels/_backend.py resolve) picks torch when attn_mask is given or no kernel backend can
take the inputs. Every kernel backend module `dinfer_kernels/{triton,cuda,cpu}/attention.py` exposes

    attention(q, k, v, k_cache, v_cache, positions, seq_lens, block_table, kv_num_blocks, kv_indices,
              out, lse, block_mass, *, write_back, q_block, kv_block, scale) -> None
    SUPPORTS   the inputs it takes: "q.dtype", "q.head_dim", "attn_mask" (the resolver's supports hook)
    SDPA_DENSE {"min_rows", "min_keys"} or None: the shape rule under which the dense key prefix of a
               call goes to torch's SDPA (dinfer_kernels/attention_sdpa.py; attention_sdpa.mode()
               switches it)

with caller-allocated outputs (lse / block_mass None = not wanted; kv_num_blocks / kv_indices None =
every key block, and then q_block / kv_block are only tiling hints; block_table None = contiguous
caches [B, S, Hkv, D], else [B, MP] int32 over page pools [P, page_size, Hkv, D]). Every backend takes
the paged layout, so auto picks the same backend for paged and contiguous calls.
"""

from typing import Any, Optional, Union

import torch

from .. import _backend, _checks, _dispatch, attention_sdpa
from ..block_mask import BlockMask, cdiv
from ..reference.attention import attention_reference


@_dispatch.op("attention", mutates_args=("k_cache", "v_cache"))
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: Optional[torch.Tensor],
    write_back: bool,
    attn_mask: Optional[torch.Tensor],
    kv_num_blocks: Optional[torch.Tensor],
    kv_indices: Optional[torch.Tensor],
    q_block: int,
    kv_block: int,
    scale: float,
    return_lse: bool,
    return_block_mass: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Always returns (out, lse, block_mass); an unrequested extra is an empty [0] fp32 tensor."""
    B, W, Hq, D = q.shape
    S = _cache_len(k_cache, block_table)
    empty = q.new_empty((0,), dtype=torch.float32)
    if backend == "torch":
        bm = None if kv_num_blocks is None else (kv_num_blocks, kv_indices, q_block, kv_block)
        res = attention_reference(
            q,
            k,
            v,
            k_cache,
            v_cache,
            positions,
            seq_lens,
            write_back,
            attn_mask,
            scale,
            block_mask=bm,
            return_lse=return_lse,
            return_block_mass=return_block_mass,
            block_table=block_table,
        )
        if not (return_lse or return_block_mass):
            return res, empty, empty.clone()
        res = list(res)
        out = res.pop(0)
        lse = res.pop(0) if return_lse else empty
        mass = res.pop(0) if return_block_mass else empty.clone()
        return out, lse, mass
    out = torch.empty((B, W, Hq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, W, Hq), dtype=torch.float32, device=q.device) if return_lse else None
    mass = (
        torch.empty((B, Hq, cdiv(S, kv_block)), dtype=torch.float32, device=q.device)
        if return_block_mass
        else None
    )
    args: dict[str, Any] = dict(
        q=q,
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        positions=positions,
        seq_lens=seq_lens,
        block_table=block_table,
        kv_num_blocks=kv_num_blocks,
        kv_indices=kv_indices,
        out=out,
        lse=lse,
        block_mass=mass,
        write_back=write_back,
        q_block=q_block,
        kv_block=kv_block,
        scale=scale,
    )
    impl = _backend.impl("attention", backend)
    # dense key tiles to torch's SDPA where the backend's shape rule (or the switch) says so
    if not attention_sdpa.delegate(_backend.module("attention", backend), impl, **args):
        impl(**args)
    return out, (lse if lse is not None else empty), (mass if mass is not None else empty.clone())


@_attention_op.register_fake
def _(
    q,
    k,
    v,
    k_cache,
    v_cache,
    positions,
    seq_lens,
    block_table,
    write_back,
    attn_mask,
    kv_num_blocks,
    kv_indices,
    q_block,
    kv_block,
    scale,
    return_lse,
    return_block_mass,
    backend,
):
    B, W, Hq, D = q.shape
    S = _cache_len(k_cache, block_table)
    out = q.new_empty((B, W, Hq, D))
    lse = q.new_empty((B, W, Hq) if return_lse else (0,), dtype=torch.float32)
    mass = q.new_empty((B, Hq, cdiv(S, kv_block)) if return_block_mass else (0,), dtype=torch.float32)
    return out, lse, mass


def _cache_len(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """S: the cache length, or with a block table the positions its pages cover."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    block_table: Optional[torch.Tensor] = None,
    write_back: bool = True,
    attn_mask: Optional[torch.Tensor] = None,
    block_mask: Optional[BlockMask] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
    return_block_mass: bool = False,
    backend: str = "auto",
    validate: Optional[bool] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """out [B, W, Hq, D], or (out, lse?, block_mass?) with only the requested extras, in that order.
    See the reference docstring for every argument; block_mask is a BlockMask. block_table
    [B, MP] int32: k_cache / v_cache are page pools [P, page_size, Hkv, D] shared by the sequences,
    and the cache length is S = MP * page_size (the reference's docstring).

    validate: check tensor *values* (positions, seq_lens, block lists). Default: on host tensors only
    (on a GPU it would synchronise, and under capture it is impossible); the kernels never read out
    of bounds whatever the values are."""
    _checks.tensor("q", q, _checks.FLOAT_DTYPES, ndim=4)
    dev = q.device
    B, W, Hq, D = q.shape
    _checks.tensor("k_cache", k_cache, (q.dtype,), ndim=4, device=dev)
    Hkv = k_cache.shape[2]
    if block_table is None:
        S = k_cache.shape[1]
        _checks.shape("k_cache", k_cache, [B, S, Hkv, D])
    else:
        _checks.tensor("block_table", block_table, (torch.int32,), ndim=2, device=dev)
        _checks.shape("block_table", block_table, [B, block_table.shape[1]])
        num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"k_cache: a page pool needs >= 1 page of >= 1 row, got {list(k_cache.shape)}")
        _checks.shape("k_cache", k_cache, [num_pages, page_size, Hkv, D])
        S = block_table.shape[1] * page_size
    _checks.tensor("v_cache", v_cache, (q.dtype,), ndim=4, device=dev)
    _checks.shape("v_cache", v_cache, list(k_cache.shape))
    if Hkv < 1 or Hq % Hkv:
        raise ValueError(f"k_cache: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    for name, t in (("k", k), ("v", v)):
        _checks.tensor(name, t, (q.dtype,), ndim=4, device=dev)
        _checks.shape(name, t, [B, W, Hkv, D])
    _checks.tensor("positions", positions, (torch.int64,), ndim=2, device=dev)
    _checks.shape("positions", positions, [B, W])
    _checks.tensor("seq_lens", seq_lens, (torch.int32,), ndim=1, device=dev)
    _checks.shape("seq_lens", seq_lens, [B])
    if attn_mask is not None:
        _checks.tensor("attn_mask", attn_mask, (torch.bool,), ndim=3, device=dev)
        _checks.shape("attn_mask", attn_mask, [B, W, S])
    scale = D**-0.5 if scale is None else _checks.number("scale", scale, lo=0.0, lo_open=True)
    counts: Optional[torch.Tensor]
    indices: Optional[torch.Tensor]
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(
                f"block_mask: expected a dinfer_kernels.BlockMask or None, got {type(block_mask).__name__}"
            )
        counts, indices, q_block, kv_block = block_mask
        _checks.integer("block_mask.q_block", q_block, 1)
        _checks.integer("block_mask.kv_block", kv_block, 1)
        nqb, nkb = cdiv(W, q_block), cdiv(S, kv_block)
        _checks.tensor("block_mask.kv_num_blocks", counts, (torch.int32,), ndim=3, device=dev)
        _checks.shape("block_mask.kv_num_blocks", counts, [B, Hkv, nqb])
        _checks.tensor("block_mask.kv_indices", indices, (torch.int32,), ndim=4, device=dev)
        _checks.shape("block_mask.kv_indices", indices, [B, Hkv, nqb, indices.shape[-1]])
        counts, indices = counts.contiguous(), indices.contiguous()
    else:
        if return_block_mass:
            raise ValueError(
                "block_mask: return_block_mass needs a block mask (its kv_block sets the "
                "key blocks; BlockMask.full(...) for dense attention)"
            )
        counts = indices = None
        q_block, kv_block = max(W, 1), 64  # tiling hints only
    # The caches are only written with write_back; without it they are read like q, k and v.
    caches = {"k_cache": k_cache, "v_cache": v_cache}
    reads = {
        "q": q,
        "k": k,
        "v": v,
        "positions": positions,
        "seq_lens": seq_lens,
        "block_table": block_table,
        "attn_mask": attn_mask,
        "block_mask.kv_num_blocks": block_mask and block_mask.kv_num_blocks,
        "block_mask.kv_indices": block_mask and block_mask.kv_indices,
    }
    _checks.disjoint(caches if write_back else {}, reads)
    backend = _backend.resolve(
        backend,
        dev,
        "attention",
        **{"q.dtype": q.dtype, "q.head_dim": D, "attn_mask": None if attn_mask is None else "a dense mask"},
    )

    if _checks.data_checks_possible(q) if validate is None else validate:
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= S):
            raise ValueError(f"positions: must be in [0, {S}) (the cache length)")
        if seq_lens.numel() and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > S):
            raise ValueError(f"seq_lens: must be in [0, {S}]")
        if counts is not None:
            _check_block_lists(counts, indices, nkb)
        if block_table is not None:
            _check_block_table(block_table, k_cache.shape[0], k_cache.shape[1], positions, seq_lens)
    if backend != "torch":
        # The kernels read positions / seq_lens / the block table as dense arrays and q / k / v rows
        # with a unit last stride: make them so (no-ops in the usual case; an expanded arange of
        # positions is not). The caches are written in place, so their layout is the caller's.
        positions, seq_lens = positions.contiguous(), seq_lens.contiguous()
        block_table = None if block_table is None else block_table.contiguous()
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out, lse, mass = _attention_op(
        q,
        k,
        v,
        k_cache,
        v_cache,
        positions,
        seq_lens,
        block_table,
        bool(write_back),
        attn_mask,
        counts,
        indices,
        int(q_block),
        int(kv_block),
        float(scale),
        bool(return_lse),
        bool(return_block_mass),
        backend,
    )
    if not (return_lse or return_block_mass):
        return out
    return (out,) + ((lse,) if return_lse else ()) + ((mass,) if return_block_mass else ())


def _check_block_lists(counts, indices, nkb):
    maxb = indices.shape[-1]
    if counts.numel() and (int(counts.min()) < 0 or int(counts.max()) > maxb):
        raise ValueError(f"block_mask.kv_num_blocks: counts must be in [0, {maxb}] (MAXB)")
    listed = torch.arange(maxb, device=counts.device) < counts[..., None]
    idx = indices.to(torch.int64)
    if bool(((idx < 0) | (idx >= nkb))[listed].any()):
        raise ValueError(f"block_mask.kv_indices: listed key blocks must be in [0, {nkb})")
    if maxb > 1:
        s = torch.where(listed, idx, -1 - torch.arange(maxb, device=idx.device)).sort(-1).values
        if bool(((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any()):
            raise ValueError("block_mask.kv_indices: listed key blocks must be distinct")


def _check_block_table(block_table, num_pages, page_size, positions, seq_lens):
    """The pages every sequence attends are in the pool, and the pool row of each valid window row
    is no other attended position's (the kernels write window rows into the pool, also without
    write_back: for the call, then restored)."""
    covered = torch.arange(block_table.shape[1], device=block_table.device) * page_size < seq_lens[:, None]
    bad = covered & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_table: page {j} of sequence {b} (positions before seq_lens[{b}] = "
            f"{int(seq_lens[b])}) has id {int(block_table[b, j])}, outside the pool [0, {num_pages})"
        )
    lens = seq_lens.to(torch.int64)
    valid = positions < lens[:, None]
    if not bool(valid.any()):
        return
    table = block_table.to(torch.int64)
    page = table.gather(1, positions // page_size)
    rows = (page * page_size + positions % page_size)[valid]
    if rows.numel() != rows.unique().numel():
        raise ValueError(
            "block_table: two valid window rows of the call map to the same pool row (a row written twice)"
        )
    # Every attended position's pool row (pages are in the pool: checked above), counted.
    S = table.shape[1] * page_size
    s = torch.arange(S, device=table.device)
    read = s[None, :] < lens[:, None]
    pool_rows = (table.repeat_interleave(page_size, dim=1) * page_size + s % page_size)[read]
    count = torch.bincount(pool_rows, minlength=num_pages * page_size)
    shared = count[rows] > 1
    if bool(shared.any()):
        b, w = (int(i) for i in valid.nonzero()[int(shared.nonzero()[0])])
        raise ValueError(
            f"block_table: the pool row of window row {w} of sequence {b} (position "
            f"{int(positions[b, w])}) is also the row of another position below seq_lens (a page "
            f"holding window rows is shared)"
        )
