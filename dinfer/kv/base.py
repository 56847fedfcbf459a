"""The KV-cache manager's interface: what the generator calls on it, run by run and round by round.

    check(model, cfg)                     the cache modes it takes (ValueError naming `cache`)
    __init__(model, cfg, storage, total)  the cache of a run's slots (a refusal before allocation)
    admit(request) / release(id)          a request may start now (reserving its cache) / is finished
    start_round(batch, requests, blocks, stats)
                                          the round's cache state (its own: tables, views, windows),
                                          after writing what the round's blocks need first (prefills)
    kinds(step, ran, chunk)               the kinds of a chunk's iterations ("refresh", "window", ...)
    window(rnd, block_pos, kind)          what one iteration's forward computes (a Window)
    select(rnd, keep)                     the round state of the sequences that stay (compaction)

The round state is the manager's alone: the generator holds it beside its own (BlockState) and
hands it back, never reads or writes inside it.
"""

from abc import ABC, abstractmethod
from typing import NamedTuple, Optional, Tuple

import torch


class Window(NamedTuple):
    """What one forward computes: rows at positions `pos` [B, W] of the sequences, attending keys
    [0, seq_lens[b]) (narrowed by block_mask), writing their K/V into `cache` (write_back), and the
    flat indices of the block's rows among them (`rows`, [B * bl], into B * W)."""

    pos: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor
    block_mask: Optional[object]
    write_back: bool
    cache: object
    block_table: Optional[torch.Tensor]


def block_rows(block_pos: torch.Tensor, lo: torch.Tensor, W: int) -> torch.Tensor:
    """[B * bl] flat indices (into B * W) of each sequence's block rows in a window starting at lo [B].
    Padding rows may fall outside the window: they read any row's logits."""
    B = block_pos.shape[0]
    return (
        (block_pos - lo[:, None]).clamp(0, W - 1) + W * torch.arange(B, device=lo.device)[:, None]
    ).flatten()


class KVManager(ABC):
    """The cache of `model` (a DiffusionLM) under GenerationConfig `cfg` for the rows of `storage`
    (a dinfer.batch.Batch: a row per sequence in flight), sequences of up to `max_total` positions."""

    MODES: Tuple[str, ...] = ()  # the GenerationConfig.cache values this manager runs

    @classmethod
    @abstractmethod
    def check(cls, model, cfg) -> None:
        """ValueError naming `cache` unless cfg's cache mode is one of this manager's."""

    @abstractmethod
    def __init__(self, model, cfg, storage, max_total: int): ...

    def admit(self, request) -> bool:
        """Whether `request` (a dinfer.scheduler.Request) may start now, reserving what its cache
        needs. By default every request fits its row."""
        return True

    def release(self, request_id: int) -> None:
        """Request `request_id` is finished: what admit reserved for it goes back (by default
        nothing was reserved)."""
        return None

    @abstractmethod
    def start_round(self, batch, requests: torch.Tensor, blocks: torch.Tensor, stats):
        """The round state of sequences `batch` (the round's tokens) decoding requests [B] (host)
        their blocks [B] (host); forwards the manager runs itself are counted into `stats`."""

    @abstractmethod
    def kinds(self, step: int, ran: int, chunk: int) -> tuple:
        """The kinds of the block's iterations step .. step + chunk - 1; `ran`: the fewest forwards
        any sequence of the block ran before this chunk."""

    @abstractmethod
    def window(self, rnd, block_pos: torch.Tensor, kind: str) -> Window:
        """The forward of an iteration of `kind` in round state `rnd`, whose block rows sit at
        positions block_pos [B, bl]."""

    @abstractmethod
    def select(self, rnd, keep: torch.Tensor):
        """The round state of sequences `keep` (indices) only."""
