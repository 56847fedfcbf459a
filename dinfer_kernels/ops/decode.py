"""dinfer_kernels.decode_step: the public fused decode step, registered as the torch.library op
`dinfer::decode_step` (fake impl included), so it works under torch.compile(fullgraph=True) and inside
CUDA-graph capture (cuda / triton backends: no host sync, outputs allocated by the caching allocator).

Contract: dinfer_kernels/reference/decode.py.
"""

from typing import NamedTuple, Optional, Union

import torch

from .. import _backend, _checks, _dispatch
from ..reference.decode import (
    DEFAULTS,
    RULES,
    CreditParams,
    DecodeOutput,
    DecodeParams,
    EditParams,
    RuleParams,
    SamplingParams,
    decode_params,
    decode_step_reference,
)


class CreditState(NamedTuple):
    """Sparse credit slots of a batch of block positions: ids [N, K] int32 (-1 empty), vals [N, K] fp32.

    Allocate once per batch shape; call reset_() (or reset_(rows)) when a block starts. Nothing grows
    with the request: K slots per position, whatever the number of iterations.
    """

    ids: torch.Tensor
    vals: torch.Tensor

    @staticmethod
    def empty(num_rows: int, slots: int = 16, device="cpu") -> "CreditState":
        _checks.integer("num_rows", num_rows, 0)
        _checks.integer("slots", slots, 0, 1025)
        return CreditState(
            torch.full((num_rows, slots), -1, dtype=torch.int32, device=device),
            torch.zeros((num_rows, slots), dtype=torch.float32, device=device),
        )

    def reset_(self, rows: Optional[torch.Tensor] = None) -> "CreditState":
        """Clears every slot, or only those of `rows` (an index or bool tensor)."""
        if rows is None:
            self.ids.fill_(-1)
            self.vals.zero_()
        else:
            self.ids[rows] = -1
            self.vals[rows] = 0.0
        return self

    def check(self, vocab: int) -> "CreditState":
        """Refuses slots no decode step leaves (a hand-built state), with a ValueError naming `credit`
        and the row and slot: ids outside [-1, vocab), a value that is NaN, infinite or negative, an
        empty slot (-1) holding a value, one id in two slots of a row. Such slots give NaN
        confidences or confidences above 1. Reads the values (a sync on a GPU)."""
        ids, vals = self
        checks = (
            (
                (ids < -1) | (ids >= vocab),
                lambda n, j: (
                    f"credit.ids: slot id {int(ids[n, j])} at row {n}, slot {j} is outside [-1, {vocab})"
                ),
            ),
            (
                ~torch.isfinite(vals) | (vals < 0),
                lambda n, j: (
                    f"credit.vals: value {float(vals[n, j])} at row {n}, slot {j} must be finite and >= 0"
                ),
            ),
            (
                (ids == -1) & (vals != 0),
                lambda n, j: (
                    f"credit.vals: the empty slot at row {n}, slot {j} holds {float(vals[n, j])} (must be 0)"
                ),
            ),
        )
        for bad, message in checks:
            if bool(bad.any()):
                n, j = (int(i) for i in bad.nonzero()[0])
                raise ValueError(message(n, j))
        if ids.shape[1] > 1:
            s = ids.sort(-1).values
            dup = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)
            if bool(dup.any()):
                n, j = (int(i) for i in dup.nonzero()[0])
                raise ValueError(f"credit.ids: token id {int(s[n, j])} is in two slots of row {n}")
        return self


# The torch.library boundary: the op takes the DecodeParams flat, in its field order (its schema needs
# one typed argument each), and groups them again for the reference and the backends.
@_dispatch.op("decode_step", mutates_args=("tokens", "credit_ids", "credit_vals"))
def _decode_step_op(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    seq_offsets: torch.Tensor,
    credit_ids: torch.Tensor,
    credit_vals: torch.Tensor,
    mask_id: int,
    rule: str,
    threshold: torch.Tensor,
    low_threshold: float,
    num_commit: torch.Tensor,
    temperature: float,
    seed: int,
    offset: int,
    row_keys: Optional[torch.Tensor],
    credit_alpha: float,
    credit_beta: float,
    credit_gamma: float,
    editable: Optional[torch.Tensor],
    edit_threshold: Optional[float],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    params = DecodeParams(
        mask_id,
        RuleParams(rule, threshold, low_threshold, num_commit),
        SamplingParams(temperature, seed, offset, row_keys),
        CreditParams(credit_alpha, credit_beta, credit_gamma),
        EditParams(editable, edit_threshold),
    )
    if backend == "torch":
        out = decode_step_reference(logits, tokens, seq_offsets, params, credit_ids, credit_vals)
        candidate, confidence, commit, nonfinite = (t.clone() for t in out)
        return candidate, confidence, commit, nonfinite
    N = logits.shape[0]
    new = lambda dtype: torch.empty(N, dtype=dtype, device=logits.device)
    candidate, confidence, commit, nonfinite = (
        new(torch.int64),
        new(torch.float32),
        new(torch.bool),
        new(torch.bool),
    )
    _backend.impl("decode_step", backend)(
        logits, tokens, seq_offsets, credit_ids, credit_vals, candidate, confidence, commit, nonfinite, params
    )
    return candidate, confidence, commit, nonfinite


@_decode_step_op.register_fake
def _(logits, *args):
    N = logits.shape[0]
    f = lambda dt: logits.new_empty((N,), dtype=dt)
    return f(torch.int64), f(torch.float32), f(torch.bool), f(torch.bool)


def _per_sequence(name, value, B, dtype, device):
    """A float/int broadcast to [B], or a [B] tensor checked and converted (no host sync)."""
    if isinstance(value, torch.Tensor):
        _checks.tensor(name, value, device=device)
        if value.dim() == 0:
            value = value.reshape(1).expand(B)
        _checks.shape(name, value, [B])
        return value.to(dtype).contiguous()
    if dtype == torch.int32:
        _checks.integer(name, value, 0)
    else:
        _checks.number(name, value)
    return torch.full((B,), value, dtype=dtype, device=device)


def decode_step(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    seq_offsets: torch.Tensor,
    mask_id: int,
    *,
    rule: str = "threshold",
    threshold: Union[float, torch.Tensor] = DEFAULTS.threshold,
    low_threshold: float = DEFAULTS.low_threshold,
    num_commit: Union[int, torch.Tensor, None] = None,
    temperature: float = 0.0,
    seed: int = 0,
    offset: int = 0,
    credit: Optional[CreditState] = None,
    credit_alpha: float = DEFAULTS.credit_alpha,
    credit_beta: float = DEFAULTS.credit_beta,
    credit_gamma: float = DEFAULTS.credit_gamma,
    row_keys: Optional[torch.Tensor] = None,
    editable: Optional[torch.Tensor] = None,
    edit_threshold: Optional[float] = None,
    backend: str = "auto",
    validate: Optional[bool] = None,
) -> DecodeOutput:
    """One diffusion decode step over a ragged batch of block positions (see the reference docstring).

    logits [N, V] fp32/fp16/bf16 (last dim contiguous); tokens [N] int64, updated in place;
    seq_offsets [B+1] int32; threshold: tau (threshold) or tau_high (hierarchical), float or [B];
    num_commit: k per sequence for rule="fixed" (int or [B] int32); credit: a CreditState (updated in
    place) or None; row_keys: [N] int64 noise keys of the rows (low 32 bits; default: the row
    index), so a caller can key sampling on something stabler than a row's place in the batch.
    rule="joint" (LLaDA2.1's JointThreshold): the threshold rule on masked rows, plus rewrites of
    the `editable` rows ([N] bool; None: all) whose candidate differs from their token with
    confidence > edit_threshold; edit_threshold None or <= 0 turns editing off (diffusers'
    convention).
    Returns DecodeOutput(candidate, confidence, commit, nonfinite): nonfinite[n]
    tells that row n's raw logits hold a NaN or +-inf (a broken model; the step itself still
    commits, see the reference's step 5).

    validate: check tensor *values* (token range, offsets, the credit state: CreditState.check).
    Default: on host tensors only, since on a GPU it would synchronise (and is impossible under
    capture); the kernels never read out of bounds whatever the values are.
    """
    N, V = _checks.logits_matrix("logits", logits)
    dev = logits.device
    params = decode_params(
        mask_id,
        rule=rule,
        threshold=threshold,
        low_threshold=low_threshold,
        num_commit=num_commit,
        temperature=temperature,
        seed=seed,
        offset=offset,
        row_keys=row_keys,
        credit_alpha=credit_alpha,
        credit_beta=credit_beta,
        credit_gamma=credit_gamma,
        editable=editable,
        edit_threshold=edit_threshold,
    )
    seq_offsets, ids, vals, params = _checked(N, V, dev, tokens, seq_offsets, credit, params)
    backend = _backend.resolve(backend, dev, "decode_step")
    _checks.disjoint(
        {"tokens": tokens, "credit.ids": ids, "credit.vals": vals},
        {
            "logits": logits,
            "seq_offsets": seq_offsets,
            "threshold": params.rule.threshold,
            "num_commit": params.rule.num_commit,
            "row_keys": params.sampling.row_keys,
            "editable": params.edit.editable,
        },
    )

    if (_checks.data_checks_possible(logits) if validate is None else validate) and backend != "cpu":
        _check_values(tokens, seq_offsets, params, ids, vals, N, V)  # the host kernel checks them itself
    out = _decode_step_op(
        logits,
        tokens,
        seq_offsets,
        ids,
        vals,
        params.mask_id,
        *params.rule,
        *params.sampling,
        *params.credit,
        *params.edit,
        backend,
    )
    return DecodeOutput(*out)


def _checked(N, V, dev, tokens, seq_offsets, credit, params: DecodeParams):
    """decode_step's inputs for N rows of a V-token vocabulary on `dev`, checked (the errors name the
    argument) and normalised: (seq_offsets, credit ids, credit vals, params), where params holds
    threshold [B] fp32, num_commit [B] int32, the row keys and editable rows contiguous, Python
    numbers, and edit.threshold None when editing is off."""
    _checks.tensor("tokens", tokens, (torch.int64,), ndim=1, device=dev)
    _checks.shape("tokens", tokens, [N])
    _checks.contiguous("tokens", tokens)
    _checks.tensor("seq_offsets", seq_offsets, (torch.int32,), ndim=1, device=dev)
    if seq_offsets.numel() < 1:
        raise ValueError("seq_offsets: expected [B + 1] offsets with B >= 0")
    seq_offsets = seq_offsets.contiguous()
    B = seq_offsets.numel() - 1
    mask_id = _checks.integer("mask_id", params.mask_id, 0, V)
    rule, sampling, cred, edit = params.rule, params.sampling, params.credit, params.edit
    if rule.name not in RULES:
        raise ValueError(f"rule: expected one of {sorted(RULES)}, got {rule.name!r}")
    _checks.number("low_threshold", rule.low_threshold)
    _checks.number("temperature", sampling.temperature, lo=0.0)
    seed = _checks.integer("seed", sampling.seed, 0, 2**32)
    offset = _checks.integer("offset", sampling.offset, 0, 2**32)
    _checks.number("credit_alpha", cred.alpha, lo=0.0)
    _checks.number("credit_beta", cred.beta, lo=0.0, hi=1.0)
    _checks.number("credit_gamma", cred.gamma, lo=0.0)
    if rule.name == "fixed" and rule.num_commit is None:
        raise ValueError("num_commit: required for rule='fixed'")
    thr = _per_sequence("threshold", rule.threshold, B, torch.float32, dev)
    k = _per_sequence("num_commit", 0 if rule.num_commit is None else rule.num_commit, B, torch.int32, dev)
    if credit is None:
        ids = torch.empty((N, 0), dtype=torch.int32, device=dev)
        vals = torch.empty((N, 0), dtype=torch.float32, device=dev)
    else:
        if not isinstance(credit, CreditState):
            raise TypeError(f"credit: expected a CreditState or None, got {type(credit).__name__}")
        ids, vals = credit
        _checks.tensor("credit.ids", ids, (torch.int32,), ndim=2, device=dev)
        _checks.tensor("credit.vals", vals, (torch.float32,), ndim=2, device=dev)
        _checks.shape("credit.ids", ids, [N, ids.shape[1]])
        _checks.shape("credit.vals", vals, [N, ids.shape[1]])
        _checks.contiguous("credit.ids", ids)
        _checks.contiguous("credit.vals", vals)
    row_keys = sampling.row_keys
    if row_keys is not None:
        _checks.tensor("row_keys", row_keys, (torch.int64,), ndim=1, device=dev)
        _checks.shape("row_keys", row_keys, [N])
        row_keys = row_keys.contiguous()
    editable = edit.editable
    if rule.name != "joint" and (editable is not None or edit.threshold is not None):
        given = "editable" if editable is not None else "edit_threshold"
        raise ValueError(f"{given}: only rule='joint' edits tokens, got rule={rule.name!r}")
    if editable is not None:
        _checks.tensor("editable", editable, (torch.bool,), ndim=1, device=dev)
        _checks.shape("editable", editable, [N])
        editable = editable.contiguous()
    if edit.threshold is not None:
        _checks.number("edit_threshold", edit.threshold)
    # None and <= 0 mean off (diffusers' convention)
    edit_at = None if edit.threshold is None or edit.threshold <= 0 else float(edit.threshold)
    params = DecodeParams(
        mask_id,
        RuleParams(rule.name, thr, float(rule.low_threshold), k),
        SamplingParams(float(sampling.temperature), seed, offset, row_keys),
        CreditParams(float(cred.alpha), float(cred.beta), float(cred.gamma)),
        EditParams(editable, edit_at),
    )
    return seq_offsets, ids, vals, params


def _check_values(tokens, seq_offsets, params, ids, vals, N, V):
    """The value checks of validate=True (they read the tensors: a sync on a GPU)."""
    thr, k = params.rule.threshold, params.rule.num_commit
    _checks.token_range("tokens", tokens, V)
    if int(seq_offsets[0]) != 0 or int(seq_offsets[-1]) != N or bool((seq_offsets.diff() < 0).any()):
        raise ValueError(
            f"seq_offsets: must be non-decreasing from 0 to N={N}, got {seq_offsets.tolist()[:8]}..."
        )
    if bool(torch.isnan(thr).any()):
        raise ValueError("threshold: must not be NaN")
    if bool((k < 0).any()):
        raise ValueError("num_commit: must be >= 0")
    CreditState(ids, vals).check(V)
