"""dinfer_kernels.BlockMask: FlexAttention-style block sparsity for dinfer_kernels.attention, built on
the device (fixed shapes, no host planning, capturable)."""

from typing import NamedTuple, Optional, Union

import torch

from . import _checks
from .reference.attention import block_mask_dense


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _start_tensor(start, B, device):
    """start as a [B] int64 tensor (an int is broadcast)."""
    if isinstance(start, torch.Tensor):
        _checks.tensor("start", start, (torch.int32, torch.int64), ndim=1)
        _checks.shape("start", start, [B])
        return start.to(device=device, dtype=torch.int64)
    _checks.integer("start", start, 0)
    return torch.full((B,), start, dtype=torch.int64, device=device)


class BlockMask(NamedTuple):
    """FlexAttention-style block sparsity that lives on the device (fixed shapes, no host planning).

    kv_num_blocks [B, Hkv, NQB] int32 and kv_indices [B, Hkv, NQB, MAXB] int32: the query heads of kv
    head g in query block j (window rows [j * q_block, (j + 1) * q_block)) attend only the keys of the
    key blocks kv_indices[b, g, j, :kv_num_blocks[b, g, j]] (key block i = keys [i * kv_block,
    (i + 1) * kv_block)). NQB = ceil(W / q_block); listed indices are distinct and in
    [0, ceil(S / kv_block)); entries past the count are ignored; a count of 0 gives the rows output 0
    and lse -inf. Query blocks are blocks of *window rows*, not of positions.

    Examples (W window rows at positions start + w, S the cache length):
      full bidirectional   BlockMask.full(B, Hkv, W, S, q_block, kv_block)
      LLaDA2 block-causal  BlockMask.block_causal(B, Hkv, W, S, block_len, q_block, kv_block, start)
      vicinity window      BlockMask.vicinity(B, Hkv, W, S, q_block, kv_block, start, before=256,
                                              after=128, sink=1)   # sink block + local neighbourhood
      pruned far suffix    BlockMask.vicinity(..., before=None, after=256): everything before the
                           query block, only 256 positions of the (still masked) suffix after it
      anything else        BlockMask.from_dense(mask [B, Hkv, NQB, NKB] bool, q_block, kv_block)
    """

    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    q_block: int
    kv_block: int

    @staticmethod
    def full(B: int, Hkv: int, W: int, S: int, q_block: int, kv_block: int, device="cpu") -> "BlockMask":
        """Every query block attends every key block."""
        for name, val in (("B", B), ("Hkv", Hkv), ("W", W), ("S", S)):
            _checks.integer(name, val, 0)
        _checks.integer("q_block", q_block, 1)
        _checks.integer("kv_block", kv_block, 1)
        nqb, nkb = cdiv(W, q_block), cdiv(S, kv_block)
        counts = torch.full((B, Hkv, nqb), nkb, dtype=torch.int32, device=device)
        idx = torch.arange(nkb, dtype=torch.int32, device=device).expand(B, Hkv, nqb, nkb).contiguous()
        return BlockMask(counts, idx, q_block, kv_block)

    @staticmethod
    def from_dense(mask: torch.Tensor, q_block: int, kv_block: int) -> "BlockMask":
        """From a [B, Hkv, NQB, NKB] bool block mask: listed blocks in ascending order, MAXB = NKB.
        No host sync (capturable)."""
        _checks.tensor("mask", mask, (torch.bool,), ndim=4)
        _checks.integer("q_block", q_block, 1)
        _checks.integer("kv_block", kv_block, 1)
        nkb = mask.shape[-1]
        counts = mask.sum(-1, dtype=torch.int32)
        # listed blocks first, in ascending order: sort by (not listed, index)
        order = torch.arange(nkb, device=mask.device) + (~mask).to(torch.int64) * nkb
        idx = order.argsort(-1).to(torch.int32)
        return BlockMask(counts, idx.contiguous(), q_block, kv_block)

    @staticmethod
    def block_causal(
        B: int,
        Hkv: int,
        W: int,
        S: int,
        block_len: int,
        q_block: int,
        kv_block: int,
        start: Union[int, torch.Tensor] = 0,
        device="cpu",
    ) -> "BlockMask":
        """LLaDA2's block-causal mask: a query at absolute position p sees the keys of every diffusion
        block up to its own, i.e. keys s < (p // block_len + 1) * block_len.

        Alignment, needed for the mask to be exact at block granularity: window row w sits at
        position start[b] + w, start is a multiple of block_len, and q_block and kv_block divide
        block_len (so a query block lies in one diffusion block and a key block never straddles a
        diffusion-block boundary). Otherwise pass a dense attn_mask (torch backend) instead.
        start: int or [B] tensor (a device tensor keeps it capturable; its values are not checked).
        """
        _checks.integer("block_len", block_len, 1)
        _checks.integer("q_block", q_block, 1)
        _checks.integer("kv_block", kv_block, 1)
        if block_len % q_block:
            raise ValueError(f"q_block: must divide block_len ({block_len}), got {q_block}")
        if block_len % kv_block:
            raise ValueError(f"kv_block: must divide block_len ({block_len}), got {kv_block}")
        if isinstance(start, int) and not isinstance(start, bool) and start % block_len:
            raise ValueError(f"start: must be a multiple of block_len ({block_len}), got {start}")
        st = _start_tensor(start, B, device)
        nqb, nkb = cdiv(W, q_block), cdiv(S, kv_block)
        q_pos = st[:, None] + torch.arange(nqb, device=device) * q_block  # [B, NQB]
        limit = (torch.div(q_pos, block_len, rounding_mode="floor") + 1) * block_len  # keys < limit
        counts = torch.clamp(_cdiv_t(limit, kv_block), 0, nkb).to(torch.int32)
        counts = counts[:, None, :].expand(B, Hkv, nqb).contiguous()
        idx = torch.arange(nkb, dtype=torch.int32, device=device).expand(B, Hkv, nqb, nkb).contiguous()
        return BlockMask(counts, idx, q_block, kv_block)

    @staticmethod
    def vicinity(
        B: int,
        Hkv: int,
        W: int,
        S: int,
        q_block: int,
        kv_block: int,
        start: Union[int, torch.Tensor] = 0,
        before: Optional[int] = None,
        after: Optional[int] = None,
        sink: int = 0,
        device="cpu",
    ) -> "BlockMask":
        """Local attention at block granularity: query block j (window rows [j*q_block, ...), at
        positions start + j*q_block ...) attends every key block that overlaps positions
        [first - before, last + after] (first/last: the block's first and last query position), plus
        the first `sink` key blocks. before/after None = unbounded: vicinity(before=None, after=A)
        is far-suffix pruning (the whole prefix, A positions of the suffix).
        start: int or [B] tensor, as in block_causal."""
        _checks.integer("q_block", q_block, 1)
        _checks.integer("kv_block", kv_block, 1)
        _checks.integer("sink", sink, 0)
        if before is not None:
            _checks.integer("before", before, 0)
        if after is not None:
            _checks.integer("after", after, 0)
        st = _start_tensor(start, B, device)
        nqb, nkb = cdiv(W, q_block), cdiv(S, kv_block)
        first = st[:, None] + torch.arange(nqb, device=device) * q_block  # [B, NQB]
        last = first + q_block - 1
        lo = first - before if before is not None else torch.full_like(first, -1 << 40)
        hi = last + after if after is not None else torch.full_like(first, 1 << 40)
        kb = torch.arange(nkb, device=device)
        k_first, k_last = kb * kv_block, kb * kv_block + kv_block - 1
        dense = (k_last[None, None, :] >= lo[..., None]) & (k_first[None, None, :] <= hi[..., None])
        dense = dense | (kb < sink)[None, None, :]
        dense = dense[:, None].expand(B, Hkv, nqb, nkb)
        return BlockMask.from_dense(dense, q_block, kv_block)

    def to_dense(self, S: int) -> torch.Tensor:
        """[B, Hkv, NQB, ceil(S / kv_block)] bool: the listed key blocks."""
        return block_mask_dense(self.kv_num_blocks, self.kv_indices, cdiv(S, self.kv_block))


def _cdiv_t(t, d):
    return torch.div(t + (d - 1), d, rounding_mode="floor")
