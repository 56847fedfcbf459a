"""The KV-cache manager of bidirectional models (LLaDA, LLaDA-MoE): a contiguous cache per sequence
slot, rebuilt by full refreshes and partially recomputed by window steps.

Every row of a bidirectional model sees the whole sequence, [MASK]s after the block included, so the
K/V of committed tokens go stale as the suffix is decoded. Each block starts with a full refresh (a
forward over the whole sequence that rebuilds the cache); in between, a window step recomputes the
rows the cache mode names (dInfer's prefix / dual / vicinity caches; none: every step a refresh):

    none      everything            prefix   from the block to the sequence's end
    dual      the block             vicinity [block - prefix_look, block + after_look)

A window's start depends only on its own sequence, and rows past a sequence's end are padding, so a
sequence computes the same alone or in a batch.
"""

from typing import NamedTuple

import torch

from ..batch import Batch
from ..graphs import enabled_for as graphs_enabled_for
from ..params import check_memory
from .base import KVManager, Window, block_rows

MODES = ("none", "prefix", "dual", "vicinity")


def window(batch: Batch, k: torch.Tensor, mode: str, prefix_look: int, after_look: int):
    """(start [B], W) of the rows a window step recomputes for each sequence's block k[b] under `mode`."""
    bl, S = batch.block_length, batch.max_len
    start = batch.block_start(k)
    if mode == "none":
        return torch.zeros_like(start), S
    if mode == "dual":
        return start, bl
    if mode == "vicinity":
        return (start - prefix_look).clamp(min=0), prefix_look + bl + after_look
    if mode == "prefix":
        return start, max(1, int((batch.total_len.to(torch.int64) - start).max()))
    raise ValueError(f"cache: expected one of {MODES}, got {mode!r}")


class RoundCache(NamedTuple):
    """A round's view of the cache and its windows."""

    cache: object  # KVCache: the head of each slot buffer seen as [B, S, Hkv, D], contiguous
    window_lo: torch.Tensor  # [B] where each sequence's window step starts
    window_len: int
    seq_lens: torch.Tensor  # [B] int32: each sequence's length (keys attended)
    max_len: int  # positions of the round's rows (a refresh's window)


class RefreshKV(KVManager):
    """A contiguous cache row per slot, of storage.max_len positions (KVManager); max_total is not
    needed: every row holds its sequence whole, so every request fits (admit's default)."""

    MODES = MODES

    @classmethod
    def check(cls, model, cfg) -> None:
        if cfg.cache not in MODES:
            raise ValueError(
                f"cache: a bidirectional model ({model.config.family}) takes one of {MODES}, got {cfg.cache!r}"
            )

    def __init__(self, model, cfg, storage: Batch, max_total: int):
        self.check(model, cfg)
        self.model, self.cfg = model, cfg
        slots, width = storage.size, storage.max_len
        rows = slots * width  # the cache, and a refresh's forward over every row
        what = f"a run of {slots} sequence(s) x {width} positions"
        check_memory(
            model, rows, rows, slots * cfg.block_length, what, graphs_enabled_for(model, cfg)
        )  # a refusal, not an OOM
        self.cache = model.new_cache(slots, width)

    def start_round(self, batch: Batch, requests, blocks, stats) -> RoundCache:
        """The round's cache: the head of each slot buffer as [B, S, Hkv, D]. What a block leaves
        there is never read again (every block starts with a refresh)."""
        B, S = batch.size, batch.max_len
        cache = type(self.cache)(
            [_head(t, B, S) for t in self.cache.keys], [_head(t, B, S) for t in self.cache.values]
        )
        lo, W = window(batch, blocks, self.cfg.cache, self.cfg.prefix_look, self.cfg.after_look)
        return RoundCache(cache, lo, W, batch.total_len, S)

    def kinds(self, step: int, ran: int, chunk: int) -> tuple:
        """ "refresh" or "window" (the warm-up is per sequence, so `ran` counts: a newcomer gets its
        own)."""
        c = self.cfg

        def refresh(s: int, r: int) -> bool:
            return (
                s == 0
                or c.cache == "none"
                or r < c.warmup_steps
                or (c.refresh_every > 0 and s % c.refresh_every == 0)
            )

        return tuple("refresh" if refresh(step + j, ran + j) else "window" for j in range(chunk))

    def window(self, rc: RoundCache, block_pos: torch.Tensor, kind: str) -> Window:
        refresh = kind == "refresh"
        lo = torch.zeros_like(rc.window_lo) if refresh else rc.window_lo
        W = rc.max_len if refresh else rc.window_len
        pos = (lo[:, None] + torch.arange(W, device=lo.device)).clamp(max=rc.max_len - 1)
        rows = block_rows(block_pos, lo, W)
        return Window(pos, rows, rc.seq_lens, None, refresh or self.cfg.write_back, rc.cache, None)

    def select(self, rc: RoundCache, keep: torch.Tensor) -> RoundCache:
        """The round cache of sequences `keep` only. Their cache rows move to the head of each slot
        buffer, seen as [len(keep), S, Hkv, D] (nothing a block's iterations write into the cache is
        read after the block, whose successor starts with a refresh): every round cache of a shape
        is the same memory, so CUDA graphs' static states share the cache rather than copy it."""
        B, S = keep.numel(), rc.max_len

        def moved(buffers, heads):
            return [_head(t, B, S).copy_(h[keep]) for t, h in zip(buffers, heads)]

        cache = type(rc.cache)(
            moved(self.cache.keys, rc.cache.keys), moved(self.cache.values, rc.cache.values)
        )
        return RoundCache(cache, rc.window_lo[keep], rc.window_len, rc.seq_lens[keep], rc.max_len)


def _head(buffer: torch.Tensor, B: int, S: int) -> torch.Tensor:
    return buffer.view(-1)[: B * S * buffer[0, 0].numel()].view(B, S, *buffer.shape[2:])
