"""dinfer_kernels.decode_step_vocab_parallel / soft_embedding_vocab_parallel: the decode step and
the iteration-smoothing input over a vocabulary split across the ranks of a torch.distributed
process group, without any rank holding the [N, V] logits.

Contract and math: dinfer_kernels/reference/vocab_parallel.py. Rank r of `group` passes the
logits columns of the ids [vocab_start, vocab_start + Vr) (the shards tile [0, vocab_size) in rank
order, each at least one id); every rank passes the same tokens, offsets, thresholds and credit
state, and gets the same results (the credit and token updates in place are identical on every rank).

Communication per call: decode_step, one all_gather of (N + 1) x (10 + K) 32-bit words per rank (the
rows' records plus a header with the rank's shard, checked when values are checked);
soft_embedding, one all-reduce of [M, H] fp32 when the caller passes the decode's row statistics
(tau == 1, what the engine does), else one all_gather of [M, 2] first.

What runs where: each rank's pass over its shard, the merge and the finalize are torch (vectorised
over rows, no [N, Vr] copies beyond the sanitised shard and, at T > 0, its noise); the commit rules
are the reference's per-sequence code (decode.commit_rows), which reads values on the host: the step
is not CUDA-graph capturable yet. These are plain functions, not torch.library ops (the process
group is a Python object).
"""

from typing import Optional, Union

import torch
import torch.distributed as dist

from .. import _checks
from ..reference import vocab_parallel as ref
from ..reference.decode import DEFAULTS, decode_params
from .decode import CreditState, _check_values, _checked


def _gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _shard(logits, vocab_start, vocab_size, group):
    """(N, Vr, rank, world) after the shard's checks."""
    N, Vr = _checks.logits_matrix("logits", logits)
    vocab_size = _checks.integer("vocab_size", vocab_size, 1)
    vocab_start = _checks.integer("vocab_start", vocab_start, 0)
    if vocab_start + Vr > vocab_size:
        raise ValueError(
            f"vocab_start: the shard's ids [{vocab_start}, {vocab_start + Vr}) lie outside the "
            f"vocabulary [0, {vocab_size})"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialised (init_process_group first)")
    return N, Vr, vocab_start, vocab_size, dist.get_rank(group), dist.get_world_size(group)


def _check_tiling(header: torch.Tensor, vocab_size: int, rows: int) -> None:
    """header [world, 3] int32: each rank's (vocab_start, Vr, rows). ValueError unless the shards
    tile [0, vocab_size) in rank order and every rank decodes the same rows."""
    v = 0
    for r, (start, width, n) in enumerate(header.tolist()):
        if n != rows:
            raise ValueError(f"logits: rank {r} passed {n} rows, this rank {rows}")
        if start != v:
            raise ValueError(
                f"vocab_start: rank {r}'s shard starts at id {start}, expected {v} (the shards must "
                f"tile [0, {vocab_size}) in rank order)"
            )
        v += width
    if v != vocab_size:
        raise ValueError(f"vocab_size: the shards cover [0, {v}), not [0, {vocab_size})")


def decode_step_vocab_parallel(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    seq_offsets: torch.Tensor,
    mask_id: int,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
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
    validate: Optional[bool] = None,
) -> ref.VocabParallelDecodeOutput:
    """decode_step on the logits shard [N, Vr] of ids [vocab_start, vocab_start + Vr) of this rank of
    `group` (None: the default group); every other argument as decode_step's, the same on every
    rank (mask_id and token ids are global, in [0, vocab_size)). Returns decode_step's outputs
    plus row_max / row_sum, each row's raw statistics over the whole vocabulary (for
    soft_embedding_vocab_parallel). validate: as decode_step's (default: on host tensors), and
    checks that the ranks' shards tile the vocabulary."""
    N, Vr, vocab_start, vocab_size, rank, world = _shard(logits, vocab_start, vocab_size, group)
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
    seq_offsets, ids, vals, params = _checked(N, vocab_size, dev, tokens, seq_offsets, credit, params)
    check = _checks.data_checks_possible(logits) if validate is None else validate
    if check:
        _check_values(tokens, seq_offsets, params, ids, vals, N, vocab_size)
    K = ids.shape[1]
    credit_ids, credit_vals = (ids, vals) if K else (None, None)
    record = torch.empty(N + 1, ref.RECORD_FIELDS + K, dtype=torch.float32, device=dev)
    record[:N] = ref.shard_record(logits, vocab_start, params, credit_ids)
    header = record[N].view(torch.int32)
    header.zero_()
    header[:3] = torch.tensor([vocab_start, Vr, N], dtype=torch.int32)
    records = torch.empty(world * (N + 1), record.shape[1], dtype=torch.float32, device=dev)
    _gather(records, record, group)
    records = records.view(world, N + 1, -1)
    if check:
        _check_tiling(records[:, N, :3].view(torch.int32).cpu(), vocab_size, N)
    merged = ref.merge_records(records[:, :N])
    return ref.finish_step(merged, tokens, seq_offsets, vocab_size, params, credit_ids, credit_vals)


def soft_embedding_vocab_parallel(
    logits: torch.Tensor,
    embedding: torch.Tensor,
    tokens: torch.Tensor,
    mask_id: int,
    weight: Union[float, torch.Tensor],
    tau: float = 1.0,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    row_max: Optional[torch.Tensor] = None,
    row_sum: Optional[torch.Tensor] = None,
    validate: Optional[bool] = None,
) -> torch.Tensor:
    """soft_embedding on this rank's vocabulary shard: logits [M, Vr] and embedding rows [Vr, H] of
    the ids [vocab_start, vocab_start + Vr); tokens, mask_id, weight and tau as soft_embedding's, the
    same on every rank. row_max / row_sum: the rows' statistics of logits / tau over the whole
    vocabulary when known (decode_step_vocab_parallel's, valid for tau == 1), which saves a
    collective. Returns the full [M, H] in the embedding's dtype on every rank (an fp32 all-reduce)."""
    M, Vr, vocab_start, vocab_size, rank, world = _shard(logits, vocab_start, vocab_size, group)
    dev = logits.device
    _checks.tensor("embedding", embedding, _checks.FLOAT_DTYPES, ndim=2, device=dev)
    if embedding.shape[0] != Vr:
        raise ValueError(f"embedding: expected the shard's {Vr} rows, got {embedding.shape[0]}")
    _checks.tensor("tokens", tokens, (torch.int64,), ndim=1, device=dev)
    _checks.shape("tokens", tokens, [M])
    mask_id = _checks.integer("mask_id", mask_id, 0, vocab_size)
    _checks.number("tau", tau, lo=0.0, lo_open=True)
    w: Union[float, torch.Tensor]
    if isinstance(weight, torch.Tensor):
        _checks.tensor("weight", weight, device=dev)
        if weight.numel() not in (1, M):
            raise ValueError(
                f"weight: expected one element or [{M}] (one per row), got shape {list(weight.shape)}"
            )
        w = weight.reshape(-1).to(torch.float32)
    else:
        w = float(_checks.number("weight", weight))
    if (row_max is None) != (row_sum is None):
        raise ValueError("row_max, row_sum: give both (the rows' statistics) or neither")
    if row_max is not None:
        for name, t in (("row_max", row_max), ("row_sum", row_sum)):
            _checks.tensor(name, t, (torch.float32,), ndim=1, device=dev)
            _checks.shape(name, t, [M])
    if _checks.data_checks_possible(logits) if validate is None else validate:
        _checks.token_range("tokens", tokens, vocab_size)
    if row_max is None or row_sum is None:
        stats = torch.stack(ref.softmax_stats_shard(logits, float(tau)), dim=1).contiguous()
        every = torch.empty(world * M, 2, dtype=torch.float32, device=dev)
        _gather(every, stats, group)
        every = every.view(world, M, 2)
        row_max, row_sum = ref.merge_max_sum(every[..., 0], every[..., 1])
    part = ref.soft_embedding_shard(
        logits, embedding, tokens, mask_id, w, float(tau), vocab_start, row_max, row_sum
    )
    dist.all_reduce(part, group=group)
    return part.to(embedding.dtype)
