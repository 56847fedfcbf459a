"""dInfer's own decoders (the dInfer paper, arXiv 2510.08666) — the *baseline*, not our spec.

This module restates how dInfer computes a decode step, in eager torch and in dInfer's layout, so
that tests can prove our spec (reference/decode.py) commits the same tokens and benchmarks have
something honest to beat. It is deliberately *not* optimised:

- batch layout: logits [B, L, V], x_block [B, L] int64 (one row per sequence, one block each);
- T = 0 only (every dInfer benchmark, eval and serving path uses T = 0): candidate = argmax;
- the confidence comes from a full fp32 softmax [B, L, V];
- the at-least-one rule is per row (per sequence);
- credit decoding keeps a dense fp32 credit matrix [B, L, V] per block across calls.

Known differences from our spec (both documented in reference/decode.py):
- when every masked position of a row predicts the mask token, dInfer commits nothing (and can loop
  forever); our spec commits the best non-mask fallback token of that row;
- dInfer's hierarchical rule has no mask-token removal (a row predicting MASK can win its run), and
  it is B == 1 only.
"""

import torch

from dinfer_kernels.reference.decode import DEFAULTS

AT_LEAST_ONE_EPS = 1e-5


# --------------------------------------------------------------------------------------- threshold
def dinfer_transfer_index_threshold(logits, x_block, mask_id: int, threshold: float):
    """dInfer's threshold transfer rule, pure: returns (x0, confidence, transfer).

    x0 [B, L] int64: the argmax candidate where it may commit, else the current token.
    confidence [B, L] fp32: softmax(fp32 logits)[x0] where eligible, else -inf.
    transfer [B, L] bool: the positions to commit.
    """
    masked = x_block == mask_id
    x0 = torch.argmax(logits, dim=-1)  # T == 0: no Gumbel noise
    eligible = masked & (x0 != mask_id)  # rm_mask: never commit MASK itself
    p = torch.softmax(logits.to(torch.float32), dim=-1)  # full [B, L, V] fp32 softmax
    x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
    x0 = torch.where(eligible, x0, x_block)
    confidence = torch.where(eligible, x0_p, torch.full_like(x0_p, float("-inf")))
    cut = torch.clamp(confidence.max(dim=1).values - AT_LEAST_ONE_EPS, min=-1000.0, max=threshold)
    transfer = (confidence >= cut.unsqueeze(-1)) & eligible
    return x0, confidence, transfer


def dinfer_threshold_decode(logits, x_block, mask_id: int, threshold: float):
    """One threshold decode step as dInfer does it. Mutates x_block; returns (x0, confidence, transfer)."""
    x0, confidence, transfer = dinfer_transfer_index_threshold(logits, x_block, mask_id, threshold)
    x_block.copy_(torch.where(transfer, x0, x_block))
    return x0, confidence, transfer


_COMPILED = None


def compiled_transfer_index_threshold():
    """dinfer_transfer_index_threshold wrapped in torch.compile(dynamic=True), as dInfer does (lazy)."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(dinfer_transfer_index_threshold, dynamic=True)
    return _COMPILED


def dinfer_threshold_decode_compiled(logits, x_block, mask_id: int, threshold: float):
    """dinfer_threshold_decode with the transfer rule compiled (the first call compiles)."""
    x0, confidence, transfer = compiled_transfer_index_threshold()(logits, x_block, mask_id, threshold)
    x_block.copy_(torch.where(transfer, x0, x_block))
    return x0, confidence, transfer


# ------------------------------------------------------------------------------------------ credit
class DinferCreditDecoder:
    """dInfer's CreditThresholdParallelDecoder with a dense fp32 credit matrix per block.

    decode(logits [B, L, V], x_block [B, L], block=None, threshold=None) mutates x_block and returns
    (x0, confidence, transfer) of the threshold rule applied to the fused logits.
    State is kept per block key (dInfer uses (block_start, block_end); default: the block's shape).
    All matrices are dropped when x_block has no mask left (dInfer tests the whole sequence x; here
    the caller passes the block) or on reset().
    """

    def __init__(
        self,
        mask_id: int,
        threshold: float,
        alpha: float = DEFAULTS.credit_alpha,
        beta: float = DEFAULTS.credit_beta,
        gamma: float = DEFAULTS.credit_gamma,
    ):
        self.mask_id, self.threshold = mask_id, threshold
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.credits = {}  # key -> [B, L, V] fp32
        self.iters = {}  # key -> number of decode calls on that block

    def reset(self):
        self.credits.clear()
        self.iters.clear()

    def decode(self, logits, x_block, block=None, threshold=None):
        key = tuple(x_block.shape) if block is None else tuple(block)
        if key not in self.credits:
            self.credits[key] = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
            self.iters[key] = 0
        C = self.credits[key]
        if self.iters[key] > 0:
            C.mul_(self.beta)  # global decay
        masked = x_block == self.mask_id
        probs = torch.softmax(logits.to(torch.float32), dim=-1)
        top_p, top_v = probs.max(dim=-1)  # top-1 of the RAW logits
        boost = top_p.pow(self.gamma) * masked.to(torch.float32)
        C.scatter_add_(-1, top_v.unsqueeze(-1), boost.unsqueeze(-1))
        fused = logits.to(torch.float32) + self.alpha * torch.log1p(C)  # z + alpha*log(1 + C)
        self.iters[key] += 1
        tau = self.threshold if threshold is None else threshold
        out = dinfer_threshold_decode(fused, x_block, self.mask_id, tau)
        if not bool((x_block == self.mask_id).any()):  # dInfer's host sync
            self.reset()
        return out


# ------------------------------------------------------------------------------------- hierarchical
def dinfer_hierarchy_decode(logits, x_block, mask_id: int, threshold: float, low_threshold: float):
    """dInfer's HierarchyDecoder transfer rule, B == 1. Mutates x_block; returns (x0, c, transfer)."""
    assert logits.shape[0] == 1 and x_block.shape[0] == 1, "dInfer's hierarchy decoder is B == 1 only"
    m = (x_block == mask_id)[0]
    x0 = torch.argmax(logits, dim=-1)[0]
    logp = torch.log_softmax(logits[0].to(torch.float32), dim=-1)
    p = logp.gather(-1, x0.unsqueeze(-1)).squeeze(-1).exp()
    fmin = torch.finfo(p.dtype).min
    c = torch.where(m, p, torch.full_like(p, fmin))
    prev = torch.cat([torch.zeros(1, dtype=torch.bool, device=m.device), m[:-1]])
    start = m & ~prev
    seg = torch.cumsum(start.to(torch.int64), 0) - 1
    seg = seg.clamp(min=0)  # unmasked rows before the first run: c == fmin, harmless
    nseg = int(seg.max()) + 1 if seg.numel() else 0
    segmax = torch.full((max(nseg, 1),), fmin, dtype=c.dtype, device=c.device)
    segmax = segmax.scatter_reduce(0, seg, c, reduce="amax", include_self=True)
    transfer = (c == segmax[seg]) & (c > low_threshold)
    transfer |= c > threshold
    transfer |= torch.nn.functional.one_hot(torch.argmax(c), c.numel()).to(torch.bool)
    transfer &= m
    x_block[0][transfer] = x0[transfer]  # boolean-index write (a host sync, as in dInfer)
    return x0.unsqueeze(0), c.unsqueeze(0), transfer.unsqueeze(0)
