"""The sharding plan: which canonical weight (dinfer.models.checkpoint) each rank holds, and how.

Tensor parallelism over `world` ranks, Megatron style, with expert parallelism over the same ranks:

    embed, lm_head        rows: the vocabulary, split into `world` contiguous near-equal ranges
                          (any vocabulary >= world: 157184 and the embedded models' 48 alike)
    q, k, v / qkv         rows: the rank's query heads and its KV heads (LLaDA2's fused qkv: the
                          three row ranges, concatenated); KV heads are replicated when world
                          exceeds their count (each rank then holds the one its query heads read)
    o                     columns: the rank's query heads (row-parallel: one all-reduce)
    gate, up / down       rows / columns: the rank's slice of the dense MLP width
    shared_w13 / _w2      the shared expert likewise (gate and up halves sliced alike)
    w13, w2               the rank's contiguous slice of the experts (FP8 ones: their block
                          scales w13_scale / w2_scale too)
    everything else       replicated (norms, the fp32 router and expert bias)

A size that does not divide is a ParallelConfigError naming it and its config.json key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..models.config import ModelConfig

EP_MODES = ("allreduce", "alltoall")


class ParallelConfigError(ValueError):
    """A parallel layout the model's sizes do not allow (the message names the size and its key)."""


def split(n: int, parts: int, r: int) -> Tuple[int, int]:
    """The r-th of `parts` contiguous near-equal ranges of [0, n) (the first n % parts one longer)."""
    q, extra = divmod(n, parts)
    lo = r * q + min(r, extra)
    return lo, lo + q + (r < extra)


Ranges = Tuple[int, List[Tuple[int, int]]]  # (dim, [(lo, hi), ...]): those slices, concatenated


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig  # the checkpoint's (global) config
    world: int
    rank: int
    ep_mode: str = "allreduce"

    def __post_init__(self):
        c, n = self.config, self.world
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParallelConfigError(f"tensor_parallel_size: expected an integer >= 1, got {n!r}")
        if not 0 <= self.rank < n:
            raise ParallelConfigError(f"rank: expected 0 <= rank < {n}, got {self.rank}")
        if self.ep_mode not in EP_MODES:
            raise ParallelConfigError(
                f"expert_parallel: expected one of {', '.join(EP_MODES)}, got {self.ep_mode!r}"
            )
        key = c.hf_key

        def divides(size: int, what: str, field: str) -> None:
            if size % n:
                raise ParallelConfigError(
                    f"tensor_parallel_size {n} does not divide the {size} {what} ({key(field)})"
                )

        divides(c.num_heads, "attention heads", "num_heads")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise ParallelConfigError(
                f"tensor_parallel_size {n} neither divides nor is a multiple of the {c.num_kv_heads} "
                f"KV heads ({key('num_kv_heads')}): KV heads are split, or replicated when fewer than ranks"
            )
        if c.intermediate_size:
            divides(c.intermediate_size, "dense MLP channels", "intermediate_size")
        if c.shared_intermediate_size:
            divides(c.shared_intermediate_size, "shared-expert channels", "shared_intermediate_size")
        if c.is_moe:
            divides(c.num_experts, "experts", "num_experts")
        if c.vocab_size < n:
            raise ParallelConfigError(
                f"tensor_parallel_size {n} exceeds the vocabulary of {c.vocab_size} ({key('vocab_size')})"
            )

    # ---- what this rank holds
    @property
    def heads(self) -> Tuple[int, int]:
        """The rank's query heads [h0, h1)."""
        q = self.config.num_heads // self.world
        return self.rank * q, (self.rank + 1) * q

    @property
    def kv_heads(self) -> Tuple[int, int]:
        """The rank's KV heads [g0, g1): its share, or the one its query heads read (replicated)."""
        c = self.config
        if self.world <= c.num_kv_heads:
            g = c.num_kv_heads // self.world
            return self.rank * g, (self.rank + 1) * g
        g = self.rank // (self.world // c.num_kv_heads)
        return g, g + 1

    @property
    def vocab(self) -> Tuple[int, int]:
        return split(self.config.vocab_size, self.world, self.rank)

    @property
    def experts(self) -> Tuple[int, int]:
        e = self.config.num_experts // self.world
        return self.rank * e, (self.rank + 1) * e

    def _width(self, size: int) -> Tuple[int, int]:
        w = size // self.world
        return self.rank * w, (self.rank + 1) * w

    @property
    def local_config(self) -> ModelConfig:
        """The config of what this rank computes: its query and KV heads (the KV cache's shape);
        every other field (the vocabulary size, the special ids) is the model's."""
        (h0, h1), (g0, g1) = self.heads, self.kv_heads
        return dataclasses.replace(self.config, num_heads=h1 - h0, num_kv_heads=g1 - g0)

    def ranges(self, name: str) -> Optional[Ranges]:
        """How the canonical weight `name` is sliced on this rank; None: replicated."""
        c, D = self.config, self.config.head_dim
        base = name.rsplit(".", 1)[-1]
        (h0, h1), (g0, g1) = self.heads, self.kv_heads
        q, kv = (h0 * D, h1 * D), (g0 * D, g1 * D)
        if base in ("embed", "lm_head"):
            return 0, [self.vocab]
        if base == "q":
            return 0, [q]
        if base in ("k", "v"):
            return 0, [kv]
        if base == "qkv":
            Q, KV = c.num_heads * D, c.num_kv_heads * D
            return 0, [q, (Q + kv[0], Q + kv[1]), (Q + KV + kv[0], Q + KV + kv[1])]
        if base == "o":
            return 1, [q]
        if base in ("gate", "up"):
            return 0, [self._width(c.intermediate_size)]
        if base == "down":
            return 1, [self._width(c.intermediate_size)]
        if base == "shared_w13":
            S, (s0, s1) = c.shared_intermediate_size, self._width(c.shared_intermediate_size)
            return 0, [(s0, s1), (S + s0, S + s1)]
        if base == "shared_w2":
            return 1, [self._width(c.shared_intermediate_size)]
        if base in ("w13", "w2", "w13_scale", "w2_scale"):  # FP8 experts' block scales go with them
            return 0, [self.experts]
        return None

    def take(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the canonical tensor `full` (a view when it is one slice)."""
        r = self.ranges(name)
        if r is None:
            return full
        dim, parts = r
        views = [full.narrow(dim, lo, hi - lo) for lo, hi in parts]
        return views[0] if len(views) == 1 else torch.cat(views, dim)

    def shard_weights(self, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """This rank's weights from the full canonical ones, each its own contiguous copy."""
        return {name: self.take(name, t).contiguous().clone() for name, t in weights.items()}


def weight_bytes(weights: Dict[str, torch.Tensor]) -> int:
    """The bytes of the weights' elements (views of a memory-mapped file count their own bytes)."""
    return sum(t.numel() * t.element_size() for t in weights.values())
