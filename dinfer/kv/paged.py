"""The KV-cache manager of block diffusion (LLaDA2): an append-only paged cache.

A block-causal model's blocks see themselves and the blocks before them, never the ones after. So
the K/V of a committed block, once computed from its final tokens, are exact for the rest of the
sequence: they are written once and kept, never refreshed. The cache is a pool of fixed-size pages
per layer ([num_pages, page_size, Hkv, D], K and V; a page is one block) shared by every sequence,
and a block table per sequence (its pages in position order, vLLM-style), the layout
dinfer_kernels.attention takes with `block_table`.

The forwards of a sequence (blocks on the grid from position 0; the first decoded block may hold
the prompt's tail, never decoded or edited):

    prefill   the prompt's whole blocks, in chunks of prefill_chunk positions (whole blocks) under the
              block-causal mask; they write the prompt's K/V and read no logits
    fused     a block's first forward: rows [previous block | block], the previous block's rows
              unable to see the block (the block-causal mask). The previous block's last forward
              still saw [MASK]s; these rows recompute its K/V from its final tokens and write them
              (the clean K/V), while the block's rows already attend to them: no extra forward
              (dInfer's cross-block update)
    step      the block's rows over the cached prefix (their K/V are written too, and rewritten by
              the next step)
With clean_kv="forward" the clean K/V come from one extra forward over the previous block at the
start of each block instead (`persist`), and every decoding forward is a step: the same cache and
tokens, one forward more per block (tests/engine/test_block_diffusion.py).

Pages are bookkept on the host: a prompt is admitted only when the pages its whole sequence will
need are free (a reservation, so an admitted sequence never waits for pages mid-run), takes them as
its blocks start, and gives them all back when it is finished, for the next prompt.
"""

from typing import Dict, List, NamedTuple

import torch

import dinfer_kernels as dk

from ..batch import Batch, first_block
from ..graphs import enabled_for as graphs_enabled_for
from ..params import check_memory
from ..scheduler import Request
from .base import KVManager, Window, block_rows

MODES = ("paged",)
CLEAN_KV = ("fused", "forward")


def pages_for(positions: int, page_size: int) -> int:
    return -(-positions // page_size)


class PagePool:
    """Per-layer page pools of `model` (a DiffusionLM): `keys` / `values`, as the model's forward takes
    a cache, with `num_pages` pages of `page_size` rows; and the host bookkeeping of which sequence
    holds which page."""

    def __init__(self, model, num_pages: int, page_size: int):
        c = model.config
        shape = (num_pages, page_size, c.num_kv_heads, c.head_dim)
        zeros = lambda: torch.zeros(shape, dtype=model.dtype, device=model.device)
        self.keys = [zeros() for _ in range(c.num_layers)]
        self.values = [zeros() for _ in range(c.num_layers)]
        self.num_pages, self.page_size, self.device = num_pages, page_size, model.device
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: the lowest page is taken first
        self._reserved: Dict[int, int] = {}  # sequence -> pages it may still take
        self._pages: Dict[int, List[int]] = {}  # sequence -> its pages, in position order

    def can_admit(self, positions: int) -> bool:
        """Whether a sequence of `positions` positions fits beside the admitted ones."""
        return pages_for(positions, self.page_size) <= len(self._free) - sum(self._reserved.values())

    def admit(self, seq: int, positions: int) -> None:
        """Reserves the pages sequence `seq` will take for its `positions` positions."""
        if not self.can_admit(positions):
            raise RuntimeError(f"internal error: sequence {seq} admitted without free pages")
        self._reserved[seq], self._pages[seq] = pages_for(positions, self.page_size), []

    def grow(self, seq: int, positions: int) -> None:
        """Sequence `seq` takes pages (from its reservation) until they cover `positions` positions."""
        pages = self._pages[seq]
        while len(pages) * self.page_size < positions:
            if self._reserved[seq] == 0:
                raise RuntimeError(f"internal error: sequence {seq} grew past its reservation")
            self._reserved[seq] -= 1
            pages.append(self._free.pop())

    def release(self, seq: int) -> None:
        """Sequence `seq` is finished: its pages and what is left of its reservation go back."""
        self._free.extend(reversed(self._pages.pop(seq, [])))
        self._reserved.pop(seq, None)

    def table(self, seqs: List[int], max_pages: int) -> torch.Tensor:
        """[len(seqs), max_pages] int32 block table on the device: each sequence's pages in position
        order, -1 past them (absent: attention never reads or writes there)."""
        t = torch.full((len(seqs), max_pages), -1, dtype=torch.int32)
        for b, s in enumerate(seqs):
            pages = self._pages[s][:max_pages]
            t[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return t.to(self.device)

    @property
    def free_pages(self) -> int:
        return len(self._free)


class PagedRound(NamedTuple):
    """A round's block tables and windows (device tensors, fixed for the round: capturable; their
    shapes depend only on the round's batch size)."""

    table: torch.Tensor  # [B, MP] int32
    start: torch.Tensor  # [B] int64: the block's first position
    fused_lo: torch.Tensor  # [B] int64: the fused window's first position (the previous block's)
    seq_lens: torch.Tensor  # [B] int32: the block's end (the canvas is whole blocks: dinfer.batch)
    fused_mask: dk.BlockMask  # block-causal over the fused window


class PagedKV(KVManager):
    """The paged cache of a block-causal model (KVManager): admits a request only when its pages
    are free."""

    MODES = MODES

    @classmethod
    def check(cls, model, cfg) -> None:
        if cfg.cache not in MODES:
            raise ValueError(
                f"cache: a block-causal model ({model.config.family}) keeps an exact append-only cache: "
                f"'paged', got {cfg.cache!r}"
            )

    def __init__(self, model, cfg, storage: Batch, max_total: int):
        self.check(model, cfg)
        self.model, self.cfg = model, cfg
        bl = self.bl = storage.block_length
        slots = storage.size
        longest = pages_for(max_total, bl)
        num_pages = cfg.kv_pages or slots * longest
        if longest > num_pages:
            raise MemoryError(
                f"kv_pages: a sequence of {max_total} positions needs {longest} pages of {bl}, "
                f"the pool has {num_pages}"
            )
        self.chunk = max(bl, cfg.prefill_chunk // bl * bl)  # prefill positions per forward
        forward_rows = slots * max(2 * bl, min(self.chunk, max_total))
        what = f"a paged cache of {num_pages} pages x {bl} positions"
        check_memory(
            model, num_pages * bl, forward_rows, slots * bl, what, graphs_enabled_for(model, cfg)
        )  # a refusal, not an OOM
        self.pool = PagePool(model, num_pages, bl)
        # The block tables' width, the same for every round (CUDA graphs replay across blocks on one
        # shape): a block's fused window [start - bl, start + bl) ends within its sequence's pages,
        # the first block's (start 0) within two pages.
        self.max_pages = max(longest, 2)
        self.total: Dict[int, int] = {}  # request id -> its positions, while admitted
        self.first: Dict[int, int] = {}  # request id -> its first block's position

    def admit(self, r: Request) -> bool:
        """Admits request r (reserving its pages) if they are free."""
        total = len(r.prompt) + r.gen_length
        if not self.pool.can_admit(total):
            return False
        self.pool.admit(r.id, total)
        self.total[r.id], self.first[r.id] = total, first_block(len(r.prompt), self.bl, True)
        return True

    def release(self, rid: int) -> None:
        self.pool.release(rid)
        del self.total[rid], self.first[rid]

    def start_round(self, batch: Batch, requests, blocks, stats) -> PagedRound:
        """Pages for every block of the round, the newcomers' prompts prefilled, and (clean_kv
        "forward") the previous blocks' clean K/V written; then the round's tables and windows."""
        bl, seqs, ks = self.bl, requests.tolist(), blocks.tolist()
        starts = [self.first[i] + k * bl for i, k in zip(seqs, blocks)]
        for i, s in zip(seqs, starts):
            self.pool.grow(i, min(s + bl, self.total[i]))
        newcomers = [b for b, k in enumerate(ks) if k == 0 and self.first[seqs[b]] > 0]
        if newcomers:
            self._prefill(batch, seqs, newcomers, stats)
        table = self.pool.table(seqs, self.max_pages)
        start = batch.block_start(blocks.to(table.device))
        fused_lo = (start - bl).clamp(min=0)
        seq_lens = torch.minimum(start + bl, batch.total_len.to(torch.int64)).to(torch.int32)
        c = self.model.config
        mask = dk.BlockMask.block_causal(
            len(seqs), c.num_kv_heads, 2 * bl, self.max_pages * bl, bl, bl, bl, fused_lo, device=table.device
        )
        rnd = PagedRound(table, start, fused_lo, seq_lens, mask)
        if self.cfg.clean_kv == "forward" and any(k > 0 for k in ks):
            self._persist(batch, blocks, rnd, stats)
        return rnd

    def kinds(self, step: int, ran: int, chunk: int) -> tuple:
        """The block's first iteration is "fused" (unless the clean K/V come from an extra forward),
        the others "step"."""
        fused = self.cfg.clean_kv == "fused"
        return tuple("fused" if fused and step + j == 0 else "step" for j in range(chunk))

    def window(self, rnd: PagedRound, block_pos: torch.Tensor, kind: str) -> Window:
        bl = self.bl
        lo, W, mask = (rnd.fused_lo, 2 * bl, rnd.fused_mask) if kind == "fused" else (rnd.start, bl, None)
        pos = lo[:, None] + torch.arange(W, device=lo.device)
        return Window(pos, block_rows(block_pos, lo, W), rnd.seq_lens, mask, True, self.pool, rnd.table)

    def select(self, rnd: PagedRound, keep: torch.Tensor) -> PagedRound:
        """The round of sequences `keep` only: their table rows (the pages stay where they are)."""
        m = rnd.fused_mask
        mask = dk.BlockMask(m.kv_num_blocks[keep], m.kv_indices[keep], m.q_block, m.kv_block)
        return PagedRound(rnd.table[keep], rnd.start[keep], rnd.fused_lo[keep], rnd.seq_lens[keep], mask)

    def _prefill(self, batch: Batch, requests: List[int], newcomers: List[int], stats) -> None:
        """The whole prompt blocks [0, first_block) of sequences `newcomers` (indices into the round;
        requests: the round's), chunk by chunk: K/V written, no logits read."""
        bl, c = self.bl, self.model.config
        seqs = [requests[b] for b in newcomers]
        chunk, longest = self.chunk, max(self.first[i] for i in seqs)
        chunks = pages_for(longest, chunk)
        table = self.pool.table(seqs, pages_for(chunks * chunk, bl))
        rows = torch.tensor(newcomers, device=table.device)
        x, first = batch.x[rows], batch.first_block[rows]
        none = torch.empty(0, dtype=torch.int64, device=table.device)
        for j in range(chunks):
            lo = j * chunk
            pos = (lo + torch.arange(chunk, device=table.device)).expand(len(seqs), chunk)
            seq_lens = first.clamp(max=lo + chunk).to(torch.int32)  # rows past the prompt's blocks: padding
            mask = dk.BlockMask.block_causal(
                len(seqs), c.num_kv_heads, chunk, table.shape[1] * bl, bl, bl, bl, lo, device=table.device
            )
            emb = self.model.embed(x.gather(1, pos.clamp(max=x.shape[1] - 1)))
            self.model.forward(
                emb, pos, self.pool, seq_lens, logits_rows=none, block_mask=mask, block_table=table
            )
            stats.prefills += 1

    def _persist(self, batch: Batch, blocks, rnd: PagedRound, stats) -> None:
        """clean_kv "forward": one forward over each sequence's previous block, from its final tokens,
        writing its clean K/V (sequences on their first block: padding rows, nothing written)."""
        bl = self.bl
        decoded = (blocks > 0).to(rnd.start.device)
        lo = (rnd.start - bl).clamp(min=0)
        pos = lo[:, None] + torch.arange(bl, device=lo.device)
        seq_lens = torch.where(decoded, rnd.start, lo).to(torch.int32)  # keys up to the block's start
        emb = self.model.embed(batch.x.gather(1, pos))
        none = torch.empty(0, dtype=torch.int64, device=lo.device)
        self.model.forward(emb, pos, self.pool, seq_lens, logits_rows=none, block_table=rnd.table)
        stats.forwards += 1
        stats.sequence_forwards += int(decoded.sum())
