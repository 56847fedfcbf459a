"""Decoding strategies: thin configurations of dinfer_kernels.decode_step (per sequence, any batch),
and the per-sequence schedules they follow.

threshold     commit every masked position with confidence >= tau (at least one per sequence)
credit        threshold on credit-fused logits (dInfer's CreditDecoding, sparse slots)
hierarchical  best of each masked run above tau_low, everything above tau_high, plus the top-1
fixed         LLaDA's fixed-steps schedule: n_k = floor(m / S) + [k < m mod S] tokens at step k of a
              block with m masked positions and S steps (lowest-confidence remasking)
joint         LLaDA2.1's JointThreshold: threshold mask-to-token commits plus token-to-token edits:
              a generated (non-prompt) position of the block whose prediction differs from its token
              with confidence > edit_threshold is rewritten; once no [MASK] is left, up to
              max_post_edit_steps more forwards edit, ending early at the first that changes nothing.
              Editing is off when edit_threshold is None or <= 0 (diffusers' convention): then joint
              is the threshold decoder. Presets (diffusers' LLaDA2.1 modes): JOINT_QUALITY
              (tau 0.7, edits above 0.5, 16 post-edit steps) and JOINT_SPEED (tau 0.5, no edits).

Schedules: the fixed steps above, and the threshold warm-up that comes with iteration smoothing,
tau_n = max(start - decay * n, tau) over a request's iterations n. Smoothing's own schedule, the
weight w_n of the soft embeddings, is SMOOTHING_WEIGHT's (GenerationConfig.smoothing_weight; the
training of dinfer.train samples its range).
"""

import copy
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

import dinfer_kernels as dk

from .params import Int, OneOf, OrNone, Real, check

# Every name but credit is the decode_step rule of that name; credit is the threshold rule on credit.
DECODERS = ("threshold", "credit", "hierarchical", "fixed", "joint")

SMOOTHING_WEIGHT = (0.15, 0.02, 0.3)  # dInfer's w_n = min(w0 + dw * n, w_max)


@dataclass(frozen=True)
class DecoderConfig:
    name: str = "threshold"
    threshold: float = dk.DECODE_DEFAULTS.threshold  # tau, or tau_high for hierarchical
    low_threshold: float = dk.DECODE_DEFAULTS.low_threshold  # tau_low for hierarchical
    steps_per_block: int = 0  # fixed: steps per block (0: one token per step)
    credit_slots: int = 16
    credit_alpha: float = dk.DECODE_DEFAULTS.credit_alpha
    credit_beta: float = dk.DECODE_DEFAULTS.credit_beta
    credit_gamma: float = dk.DECODE_DEFAULTS.credit_gamma
    temperature: float = 0.0
    seed: int = 0
    edit_threshold: Optional[float] = None  # joint: rewrite above this confidence (None / <= 0: off)
    max_post_edit_steps: int = 16  # joint: forwards that only edit, after the block's last [MASK]

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
                edit_threshold=OrNone(Real(hi=1.0)),
                max_post_edit_steps=Int(0),
            ),
            names=dict(name="decoder"),
        )
        if self.name != "joint" and self.edit_threshold is not None:
            raise ValueError(
                f"edit_threshold: only the joint decoder edits tokens, got decoder {self.name!r}"
            )

    @property
    def edits(self) -> bool:
        """Whether this decoder rewrites committed tokens (joint with editing on)."""
        return self.name == "joint" and self.edit_threshold is not None and self.edit_threshold > 0


# diffusers' recommended LLaDA2.1 modes (block length 32, T = 0)
JOINT_QUALITY = DecoderConfig(name="joint", threshold=0.7, edit_threshold=0.5, max_post_edit_steps=16)
JOINT_SPEED = DecoderConfig(name="joint", threshold=0.5, edit_threshold=None, max_post_edit_steps=16)


class Decoder:
    """Per-block decoder state for B sequences of block_length rows each. warmup: (start, decay) of
    the threshold warm-up, or None for the fixed tau; tau: [B] each sequence's threshold (default:
    the config's). parallel: the model's TensorParallel (the logits are its rank's vocabulary range:
    the step is dinfer_kernels.decode_step_vocab_parallel, whose outputs add the rows' statistics).

    A sequence's block is *settled* when it holds no [MASK] and, for an editing decoder, its
    post-edit steps are over: the last changed nothing, or max_post_edit_steps of them ran. A
    settled sequence's further steps (an unrolled chunk runs on until the host looks) change nothing:
    its rows are not editable and hold no [MASK]. All of it stays on the device."""

    def __init__(
        self,
        cfg: DecoderConfig,
        batch: int,
        block_length: int,
        mask_id: int,
        device,
        warmup: Optional[Tuple[float, float]] = None,
        tau: Optional[torch.Tensor] = None,
        parallel=None,
    ):
        self.cfg = cfg
        self.parallel = parallel  # a dinfer.parallel.TensorParallel: the logits are its vocabulary range
        self.tau = (
            torch.full((batch,), cfg.threshold, dtype=torch.float32, device=device) if tau is None else tau
        )
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
        self.post_steps = torch.zeros(batch, dtype=torch.int32, device=device)  # forwards that only edited
        self.settled = torch.zeros(batch, dtype=torch.bool, device=device)

    def start_block(self, block_tokens: torch.Tensor):
        """block_tokens [B, bl]: resets credit, the fixed schedule and the post-edit steps for a new
        block."""
        if self.credit is not None:
            self.credit.reset_()
        self.step.zero_()
        self.post_steps.zero_()
        masked = (block_tokens == self.mask_id).sum(1)
        self.masked_at_start.copy_(masked)
        self.settled.copy_(masked == 0)

    def remaining(self, block_tokens: torch.Tensor) -> torch.Tensor:
        """[B] work left in each sequence's block (block_tokens [B, bl]): its [MASK] tokens, or 1
        while its post-edit steps go on; 0 once settled."""
        left = (block_tokens == self.mask_id).sum(1)
        return left + ((left == 0) & ~self.settled).to(left.dtype)

    def select(self, keep: torch.Tensor) -> "Decoder":
        """The state of sequences `keep` (indices) only, mid-block."""
        new = copy.copy(self)
        new.offsets = self.offsets[: keep.numel() + 1]
        if self.credit is not None:
            new.credit = dk.CreditState(
                *(t.view(-1, self.bl, t.shape[1])[keep].flatten(0, 1) for t in self.credit)
            )
        new.step, new.masked_at_start = self.step[keep], self.masked_at_start[keep]
        new.post_steps, new.settled, new.tau = self.post_steps[keep], self.settled[keep], self.tau[keep]
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
        if self.warmup is None:
            return self.tau
        start, decay = self.warmup
        return torch.maximum(start - decay * iters.float(), self.tau)

    def __call__(self, logits, block_tokens, iters, row_keys=None, editable=None):
        """One step on logits [B * bl, V]; block_tokens [B * bl] updated in place. iters [B]: each
        sequence's iterations so far (the threshold schedule). row_keys: [B * bl] int64
        sampling-noise keys (decode_step's row_keys). editable: [B * bl] bool, the rows an editing
        decoder may rewrite (the generated positions of the block; None: every row)."""
        c = self.cfg
        rule = "threshold" if c.name == "credit" else c.name
        B = self.step.numel()
        masked_before = (block_tokens.view(B, -1) == self.mask_id).any(1)
        edit = {}
        if c.edits:
            rows = (~self.settled).repeat_interleave(self.bl)
            edit = dict(
                editable=rows if editable is None else rows & editable, edit_threshold=c.edit_threshold
            )
        vocab = {}
        if self.parallel is not None:
            p = self.parallel
            vocab = dict(vocab_start=p.vocab_start, vocab_size=p.vocab_size, group=p.comm.group)
        out = (dk.decode_step if self.parallel is None else dk.decode_step_vocab_parallel)(
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
            **edit,
            **vocab,
        )
        self.step += 1
        left = (block_tokens.view(B, -1) == self.mask_id).sum(1)
        if c.edits:
            post = ~masked_before  # a forward after the block's last [MASK]: it could only edit
            self.post_steps += post.to(torch.int32)
            over = ~out.commit.view(B, -1).any(1) | (self.post_steps >= c.max_post_edit_steps)
            self.settled.copy_((left == 0) & ((post & over) | (c.max_post_edit_steps == 0)))
        else:
            self.settled.copy_(left == 0)
        return out
