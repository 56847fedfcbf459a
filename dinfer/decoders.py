"""Decoding strategies: thin configurations of dinfer_kernels.decode_step (per sequence, any batch),
and the per-sequence schedules they follow.

threshold     commit every masked position with confidence >= tau (at least one per sequence)
credit        threshold on credit-fused logits (dInfer's CreditDecoding, sparse slots)
hierarchical  best of each masked run above tau_low, everything above tau_high, plus the top-1
fixed         LLaDA's fixed-steps schedule: n_k = floor(m / S) + [k < m mod S] tokens at step k of a
              block with m masked positions and S steps (lowest-confidence remasking)

Schedules: the fixed steps above, and the threshold warm-up that comes with iteration smoothing,
tau_n = max(start - decay * n, tau) over a request's iterations n.
"""

import copy
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

import dinfer_kernels as dk
from dinfer_kernels.reference.decode import DEFAULTS

from .params import Int, OneOf, Real, check

# Every name but credit is the decode_step rule of that name; credit is the threshold rule on credit.
DECODERS = ("threshold", "credit", "hierarchical", "fixed")


@dataclass(frozen=True)
class DecoderConfig:
    name: str = "threshold"
    threshold: float = DEFAULTS.threshold  # tau, or tau_high for hierarchical
    low_threshold: float = DEFAULTS.low_threshold  # tau_low for hierarchical
    steps_per_block: int = 0  # fixed: steps per block (0: one token per step)
    credit_slots: int = 16
    credit_alpha: float = DEFAULTS.credit_alpha
    credit_beta: float = DEFAULTS.credit_beta
    credit_gamma: float = DEFAULTS.credit_gamma
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self):  # the rules of every field (dinfer.params); `name` is the `decoder` option
        unit = Real(0.0, 1.0)
        check(
            self,
            dict(
                name=OneOf(DECODERS),
                threshold=unit,
                low_threshold=unit,
                steps_per_block=Int(0),
                credit_slots=Int(0, 1024),
                credit_alpha=Real(0.0),
                credit_beta=unit,
                credit_gamma=Real(0.0),
                temperature=Real(0.0),
                seed=Int(0, 2**32 - 1),
            ),
            names=dict(name="decoder"),
        )


class Decoder:
    """Per-block decoder state for B sequences of block_length rows each. warmup: (start, decay) of
    the threshold warm-up, or None for the fixed tau."""

    def __init__(
        self,
        cfg: DecoderConfig,
        batch: int,
        block_length: int,
        mask_id: int,
        device,
        warmup: Optional[Tuple[float, float]] = None,
    ):
        self.cfg = cfg
        self.warmup = warmup
        self.mask_id = mask_id
        self.bl = block_length
        self.offsets = torch.arange(batch + 1, dtype=torch.int32, device=device) * block_length
        self.credit = (
            dk.CreditState.empty(batch * block_length, cfg.credit_slots, device)
            if cfg.name == "credit"
            else None
        )
        self.step = torch.zeros(batch, dtype=torch.int32, device=device)
        self.masked_at_start = torch.zeros(batch, dtype=torch.int32, device=device)

    def start_block(self, block_tokens: torch.Tensor):
        """block_tokens [B, bl]: resets credit and the fixed schedule for a new block."""
        if self.credit is not None:
            self.credit.reset_()
        self.step.zero_()
        self.masked_at_start.copy_((block_tokens == self.mask_id).sum(1))

    def select(self, keep: torch.Tensor) -> "Decoder":
        """The state of sequences `keep` (indices) only, mid-block."""
        new = copy.copy(self)
        new.offsets = self.offsets[: keep.numel() + 1]
        if self.credit is not None:
            new.credit = dk.CreditState(
                *(t.view(-1, self.bl, t.shape[1])[keep].flatten(0, 1) for t in self.credit)
            )
        new.step, new.masked_at_start = self.step[keep], self.masked_at_start[keep]
        return new

    def _num_commit(self):
        steps = self.cfg.steps_per_block or self.bl
        m = self.masked_at_start
        # Never 0 while the block holds a [MASK] (the loop's bound on forwards needs a commit per
        # step): m >= steps gives m // steps >= 1; m < steps gives 1 for the first m steps, and each
        # of those commits exactly one (decode_step's progress guarantee when none is eligible).
        return (m // steps + (self.step < m % steps).to(torch.int32)).to(torch.int32)

    def _threshold(self, iters: torch.Tensor) -> torch.Tensor:
        """[B] tau of each sequence after its iters [B] iterations."""
        tau = torch.full(iters.shape, self.cfg.threshold, dtype=torch.float32, device=iters.device)
        if self.warmup is None:
            return tau
        start, decay = self.warmup
        return torch.maximum(start - decay * iters.float(), tau)

    def __call__(self, logits, block_tokens, iters, row_keys=None):
        """One step on logits [B * bl, V]; block_tokens [B * bl] updated in place. iters [B]: each
        sequence's iterations so far (the threshold schedule). row_keys: [B * bl] int64
        sampling-noise keys (decode_step's row_keys)."""
        c = self.cfg
        rule = "threshold" if c.name == "credit" else c.name
        out = dk.decode_step(
            logits,
            block_tokens,
            self.offsets,
            self.mask_id,
            rule=rule,
            threshold=self._threshold(iters),
            low_threshold=c.low_threshold,
            num_commit=self._num_commit() if rule == "fixed" else None,
            temperature=c.temperature,
            seed=c.seed,
            credit=self.credit,
            credit_alpha=c.credit_alpha,
            credit_beta=c.credit_beta,
            credit_gamma=c.credit_gamma,
            row_keys=row_keys,
        )
        self.step += 1
        return out
