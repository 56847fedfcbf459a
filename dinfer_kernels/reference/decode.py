"""Fused decode step — the contract every backend reproduces.

One call turns the logits of a batch of diffusion blocks into committed tokens, the way dInfer's
threshold / credit / hierarchical / fixed-steps decoders do (dInfer, arXiv 2510.08666), in one read of
the logits and with all state on the device.

Inputs
------
logits       [N, V] fp32 / fp16 / bf16, last dim contiguous, row stride >= V. Row n is one block
             position of one sequence. Rows of sequence b are rows seq_offsets[b] .. seq_offsets[b+1]-1,
             in position order (the hierarchical rule needs adjacency).
tokens       [N] int64, current tokens of those positions, each in [0, V). Updated in place.
seq_offsets  [B+1] int32, non-decreasing, seq_offsets[0] == 0, seq_offsets[B] == N. Empty sequences ok.
             Unchecked values (the op checks them on host tensors only) never reach outside the rows:
             sequence b is rows [lo, hi) with lo = clamp(seq_offsets[b], 0, N), hi = clamp(
             seq_offsets[b+1], lo, N); rows covered twice or never have unspecified outputs.
mask_id      int in [0, V). A position is *masked* when tokens[n] == mask_id.
rule         "threshold" | "hierarchical" | "fixed" | "joint".
threshold    [B] fp32: tau for "threshold" and "joint", tau_high for "hierarchical" (unused by "fixed").
low_threshold  float: tau_low for "hierarchical" (default DEFAULTS.low_threshold).
num_commit   [B] int32 >= 0: k for "fixed".
editable     [N] bool or None ("joint" only): rows whose committed token may be rewritten (LLaDA2.1's
             token-to-token editing: the generated, non-prompt positions of the current block).
             None: every row.
edit_threshold  float or None ("joint" only): a non-masked editable row is rewritten when its
             candidate differs from its token with confidence > edit_threshold, compared in the
             confidences' precision (fp32, as tau is). None: editing off (the public op also reads
             <= 0 as off, the convention of diffusers' LLaDA2 pipeline; the kernels take +inf).
temperature  float >= 0. 0: candidate = argmax. > 0: Gumbel-max sample from softmax(z'/T) with the
             counter-based noise of reference/rng.py keyed by (seed, offset, row key, token v).
row_keys     [N] int64 or None: row n's noise key (low 32 bits); None: the row index n. Any values
             (nothing is read through them), so unchecked device tensors are safe.
credit_ids   [N, K] int32 and credit_vals [N, K] fp32 (K may be 0: no credit). Slot j of row n holds
             (token id, credit) or id -1 for an empty slot. Updated in place. The caller resets them
             (ids = -1, vals = 0) at a block start. A slot whose id is outside [0, V) (-1, or an
             unchecked bad id) is empty: it becomes (-1, 0) and is never read.
credit_alpha, credit_beta, credit_gamma   floats (default: DEFAULTS, dInfer's CreditDecoding).

Semantics (all math in fp32 unless compute_dtype says otherwise)
---------------------------------------------------------------
0. Sanitise: z = float(logits); NaN -> -inf; +inf -> the largest finite fp32 value.
   nonfinite[n] = whether row n of the *raw* logits holds a NaN or a +-inf anywhere (sanitising
   does not hide it: the caller can stop a run whose model produces them).
   A row whose z is -inf everywhere is *dead*: candidate = mask_id, confidence = 0, not eligible,
   credit only decays (it may still commit through step 5).
1. Raw statistics: m = max z, a = argmax z (lowest index on ties), s = sum exp(z - m), p* = 1 / s.
   (Probabilities are always exp(z - m) / s, never exp(z - (m + log s)): near FLT_MAX, m + log s
   cannot be formed.)
2. Credit (K > 0), dInfer's CreditDecoding kept sparse:
   every slot value *= beta; then, for masked live rows, the raw top-1 token a gains p* ** gamma:
   added to its slot if it has one, else stored in the first empty slot, else it replaces the slot
   with the smallest value (lowest slot on ties). With at most K distinct top-1 tokens per position
   this equals dInfer's dense credit matrix exactly.
3. Fused logits z' = z + alpha * log1p(C) (C = credit of the token, 0 if none).
   score = z' (T == 0) or z' / T + gumbel (T > 0).
   candidate = argmax score (lowest index on ties); confidence = softmax(z')[candidate].
   fallback = argmax of score over v != mask_id (none when every such z' is -inf).
4. eligible = masked and candidate != mask_id (the mask token is never committed).
   Per sequence, with c = confidence where eligible else -inf:
   - threshold:    commit eligible rows with c >= min(tau, max c - 1e-5) (dInfer's at-least-one rule);
   - hierarchical: runs = maximal runs of consecutive masked rows; commit eligible rows that hold the
                   maximum c of their run and c > tau_low, plus every eligible row with c > tau_high,
                   plus the first row holding the sequence's maximum c;
   - fixed:        commit the min(k, #eligible) eligible rows of highest c (lower row first on ties);
   - joint:        LLaDA2.1's JointThreshold: the threshold rule on the masked rows (mask-to-token),
                   plus every row that is editable, not masked, live, whose candidate is neither
                   the mask token nor its current token, with confidence > edit_threshold
                   (token-to-token; rows are edited independently of each other and of the
                   sequence's masked rows).
5. Progress guarantee (dInfer can loop forever here): if a sequence has masked rows but none is
   eligible (all predict the mask token, or are dead), the masked row whose fallback token has the
   highest probability softmax(z')[fallback] (lowest row on ties) commits its fallback token; its
   candidate and confidence outputs become that token and probability. If no masked row has a
   fallback (every one is dead or has only the mask token finite, e.g. NaN logits everywhere), the
   lowest masked row commits DEFAULT_TOKEN = the lowest id != mask_id (0, or 1 when mask_id == 0)
   with confidence 0 -- unless V == 1, where no such token exists. So, for V >= 2, every call
   commits at least one row of every sequence holding a masked row unless the rule commits none on
   purpose (fixed with k = 0): a block of L rows is done after at most L calls, whatever the
   logits. And tokens[n] == candidate[n] wherever commit[n], always.
6. tokens[n] = candidate[n] where commit[n].

Outputs: DecodeOutput(candidate [N] int64, confidence [N] fp32, commit [N] bool, nonfinite [N] bool).
"""

import math
from typing import NamedTuple, Optional

import torch

from . import rng

RULES = ("threshold", "hierarchical", "fixed", "joint")


class RuleDefaults(NamedTuple):
    threshold: float
    low_threshold: float
    credit_alpha: float
    credit_beta: float
    credit_gamma: float


# The rule parameters' defaults, written once: the op's, the reference's and the engine's
# DecoderConfig's (dInfer's LLaDA-MoE settings; the credit constants are its CreditDecoding's).
DEFAULTS = RuleDefaults(threshold=0.8, low_threshold=0.6, credit_alpha=0.7, credit_beta=0.8, credit_gamma=0.2)


class RuleParams(NamedTuple):
    """Which rows commit (step 4)."""

    name: str = "threshold"  # one of RULES
    threshold: Optional[torch.Tensor] = None  # [B] fp32: tau, or tau_high (hierarchical); None: 1
    low_threshold: float = DEFAULTS.low_threshold  # tau_low (hierarchical)
    num_commit: Optional[torch.Tensor] = None  # [B] int32: k (fixed); None: 0

    @property
    def code(self) -> int:
        """The rule as the compiled and Triton kernels take it: its place in RULES."""
        return RULES.index(self.name)


class SamplingParams(NamedTuple):
    """How the candidates are drawn (step 3): argmax at temperature 0, else Gumbel-max with rng.py's
    noise keyed by (seed, offset, row key, token)."""

    temperature: float = 0.0
    seed: int = 0
    offset: int = 0
    row_keys: Optional[torch.Tensor] = None  # [N] int64 (low 32 bits); None: the row index


class CreditParams(NamedTuple):
    """Credit decoding's constants (steps 2 and 3)."""

    alpha: float = DEFAULTS.credit_alpha
    beta: float = DEFAULTS.credit_beta
    gamma: float = DEFAULTS.credit_gamma


class EditParams(NamedTuple):
    """The joint rule's token-to-token edits (step 4)."""

    editable: Optional[torch.Tensor] = None  # [N] bool; None: every row
    threshold: Optional[float] = None  # None: editing off

    @property
    def kernel_threshold(self) -> float:
        """The threshold as the kernels take it: +inf (no confidence exceeds it) when editing is off."""
        return math.inf if self.threshold is None else self.threshold


class DecodeParams(NamedTuple):
    """Every input of the step but the logits, the tokens, the row offsets and the credit slots (module
    docstring), grouped. dinfer_kernels.decode_step builds it once, checked, and passes it whole to
    the reference and to every backend; only the torch.library op between them takes it flat, in
    this field order (mask_id, *rule, *sampling, *credit, *edit)."""

    mask_id: int
    rule: RuleParams = RuleParams()
    sampling: SamplingParams = SamplingParams()
    credit: CreditParams = CreditParams()
    edit: EditParams = EditParams()


def decode_params(
    mask_id,
    *,
    rule="threshold",
    threshold=None,
    low_threshold=DEFAULTS.low_threshold,
    num_commit=None,
    temperature=0.0,
    seed=0,
    offset=0,
    row_keys=None,
    credit_alpha=DEFAULTS.credit_alpha,
    credit_beta=DEFAULTS.credit_beta,
    credit_gamma=DEFAULTS.credit_gamma,
    editable=None,
    edit_threshold=None,
) -> DecodeParams:
    """DecodeParams from decode_step's keyword arguments (the same names; nothing is checked)."""
    return DecodeParams(
        mask_id,
        RuleParams(rule, threshold, low_threshold, num_commit),
        SamplingParams(temperature, seed, offset, row_keys),
        CreditParams(credit_alpha, credit_beta, credit_gamma),
        EditParams(editable, edit_threshold),
    )


FLT_MAX = torch.finfo(torch.float32).max
AT_LEAST_ONE_EPS = 1e-5


class DecodeOutput(NamedTuple):
    candidate: torch.Tensor
    confidence: torch.Tensor
    commit: torch.Tensor
    nonfinite: torch.Tensor


def default_token(mask_id: int) -> int:
    """Step 5's token when no masked row has a fallback: the lowest id that is not the mask."""
    return 1 if mask_id == 0 else 0


def sanitize_logits(logits: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """float(logits) with NaN -> -inf and +inf -> FLT_MAX (step 0)."""
    z = logits.to(dtype)
    z = torch.where(torch.isnan(z), torch.full_like(z, float("-inf")), z)
    return z.clamp(max=FLT_MAX)


def _max_sumexp(z: torch.Tensor):
    """Row max m and s = sum exp(z - m) (s = 0 on dead rows). Probabilities are exp(z - m) / s:
    forming m + log(s) first would lose them when m is near FLT_MAX."""
    m = z.max(dim=-1).values
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    return m, torch.exp(z - safe[:, None]).sum(-1)


def update_credit(credit_ids, credit_vals, top1, boost, boosted, beta, vocab):
    """Step 2 on the slot tensors, in place. top1/boost/boosted are per row."""
    empty = (credit_ids < 0) | (credit_ids >= vocab)
    credit_ids.masked_fill_(empty, -1)
    credit_vals.masked_fill_(empty, 0.0)
    credit_vals.mul_(beta)
    for n in torch.nonzero(boosted).flatten().tolist():
        ids, vals, tok = credit_ids[n], credit_vals[n], int(top1[n])
        hit = torch.nonzero(ids == tok).flatten()
        if hit.numel():
            vals[hit[0]] += boost[n]
            continue
        empty = torch.nonzero(ids < 0).flatten()
        slot = int(empty[0]) if empty.numel() else int(torch.argmin(vals))
        ids[slot] = tok
        vals[slot] = boost[n]


def commit_sequence(c, eligible, masked, rule, tau, tau_low, k):
    """Step 4 for one sequence. c: confidences (-inf where not eligible). Returns a bool mask."""
    L = c.numel()
    commit = torch.zeros(L, dtype=torch.bool)
    if not bool(eligible.any()):
        return commit
    if rule in ("threshold", "joint"):
        cut = torch.minimum(torch.tensor(tau, dtype=c.dtype), c.max() - AT_LEAST_ONE_EPS)
        return eligible & (c >= cut)
    if rule == "hierarchical":
        start = masked & ~torch.cat([torch.zeros(1, dtype=torch.bool), masked[:-1]])
        seg = torch.cumsum(start.to(torch.int64), 0) - 1
        for s in range(int(seg.max()) + 1 if bool(masked.any()) else 0):
            run = masked & (seg == s)
            segmax = c[run].max()
            commit |= run & eligible & (c == segmax) & (c > tau_low)
        commit |= eligible & (c > tau)
        commit[int(torch.argmax(c))] = True
        return commit
    order = sorted(range(L), key=lambda i: (-float(c[i]), i))
    for i in order[: min(int(k), int(eligible.sum()))]:
        commit[i] = True
    return commit


def decode_step_reference(
    logits,
    tokens,
    seq_offsets,
    params: DecodeParams,
    credit_ids=None,
    credit_vals=None,
    compute_dtype=torch.float32,
) -> DecodeOutput:
    """The spec (module docstring): one step with `params` (DecodeParams; decode_params builds it
    from decode_step's keyword arguments). Mutates tokens and the credit slots in place.

    compute_dtype=torch.float64 gives the high-precision truth used to size test tolerances.
    """
    N, V = logits.shape
    dev = logits.device
    nonfinite = ~torch.isfinite(logits).all(dim=-1)
    z = sanitize_logits(logits, compute_dtype)
    mask_id, sampling, credit = params.mask_id, params.sampling, params.credit
    masked = tokens == mask_id

    m, s = _max_sumexp(z)
    a = torch.argmax(z, dim=-1)
    dead = m == float("-inf")
    p_top = torch.where(dead, torch.zeros_like(m), 1.0 / s)

    if credit_ids is not None and credit_ids.shape[1] > 0:
        boost = p_top.to(torch.float32) ** credit.gamma
        update_credit(credit_ids, credit_vals, a, boost, masked & ~dead, credit.beta, V)
        dense = torch.zeros(N, V, dtype=torch.float32, device=dev)
        live = credit_ids >= 0
        rows = torch.arange(N, device=dev)[:, None].expand_as(credit_ids)
        dense[rows[live], credit_ids[live].long()] = credit_vals[live]
        zf = z + credit.alpha * torch.log1p(dense.to(compute_dtype))
    else:
        zf = z

    if sampling.temperature > 0:
        noise = rng.gumbel(sampling.seed, sampling.offset, N, V, dev, sampling.row_keys)
        score = zf / sampling.temperature + noise.to(compute_dtype)
    else:
        score = zf
    cand = torch.argmax(score, dim=-1)
    m_f, s_f = _max_sumexp(zf)
    m_f = torch.where(dead, torch.zeros_like(m_f), m_f)

    def prob(tok):  # softmax(z')[tok]
        return torch.exp(zf.gather(1, tok[:, None])[:, 0] - m_f) / s_f

    conf = prob(cand)
    cand = torch.where(dead, torch.full_like(cand, mask_id), cand)
    conf = torch.where(dead, torch.zeros_like(conf), conf)

    score_nm = score.clone()
    score_nm[:, mask_id] = float("-inf")
    fb = torch.argmax(score_nm, dim=-1)
    fb_valid = zf.gather(1, fb[:, None])[:, 0] > float("-inf")
    fb_valid &= torch.arange(V, device=dev)[fb] != mask_id
    fb_conf = torch.where(fb_valid, prob(fb), torch.full_like(conf, float("-inf")))
    fb = torch.where(fb_valid, fb, torch.full_like(fb, default_token(mask_id)))

    commit = commit_rows(cand, conf, fb, fb_conf, fb_valid, dead, masked, tokens, seq_offsets, V, params)
    return DecodeOutput(
        cand.to(torch.int64),
        conf.to(torch.float32),
        commit,
        nonfinite,
    )


def commit_rows(cand, conf, fb, fb_conf, fb_valid, dead, masked, tokens, seq_offsets, vocab, params):
    """Steps 4-6 from the per-row results of steps 0-3: candidate / confidence [N] (dead rows: the
    mask token, 0), the fallback token, its probability (-inf where none) and whether it exists,
    the dead and masked rows, and the step's DecodeParams. Applies the rule and the progress guarantee per sequence (a row that
    commits its fallback gets it as candidate and confidence, in place), the joint rule's edits,
    writes tokens in place, and returns the commit mask. Shared by every reference form of the step
    (the whole vocabulary, and the vocabulary-parallel one of reference/vocab_parallel.py)."""
    N, dev = cand.numel(), cand.device
    B = seq_offsets.numel() - 1
    mask_id, rule, edit = params.mask_id, params.rule, params.edit
    threshold, num_commit = rule.threshold, rule.num_commit
    eligible = masked & (cand != mask_id) & ~dead
    c_all = torch.where(eligible, conf, torch.full_like(conf, float("-inf")))
    commit = torch.zeros(N, dtype=torch.bool, device=dev)
    offs = seq_offsets.tolist()
    for b in range(B):
        lo = min(max(offs[b], 0), N)
        hi = min(max(offs[b + 1], lo), N)
        if hi == lo:
            continue
        tau = float(threshold[b]) if threshold is not None else 1.0
        k = int(num_commit[b]) if num_commit is not None else 0
        sl = slice(lo, hi)
        commit[sl] = commit_sequence(
            c_all[sl].cpu(), eligible[sl].cpu(), masked[sl].cpu(), rule.name, tau, rule.low_threshold, k
        ).to(dev)
        if masked[sl].any() and not eligible[sl].any() and (vocab > 1 or fb_valid[sl][masked[sl]].any()):
            cands = torch.where(
                masked[sl] & fb_valid[sl], fb_conf[sl], torch.full_like(fb_conf[sl], float("-inf"))
            )
            r = lo + int(
                torch.argmax(cands) if fb_valid[sl][masked[sl]].any() else torch.argmax(masked[sl].int())
            )
            commit[r] = True
            cand[r] = fb[r]
            conf[r] = fb_conf[r].clamp(min=0.0)  # 0 for the default token

    if rule.name == "joint" and edit.threshold is not None:
        edits = ~masked & ~dead & (cand != mask_id) & (cand != tokens) & (conf > edit.threshold)
        commit |= edits if edit.editable is None else edits & edit.editable
    tokens.copy_(torch.where(commit, cand, tokens))
    return commit
