"""The decode step and the soft embedding over a vocabulary split across ranks — the spec.

Under tensor parallelism the LM head is vocabulary-parallel: rank r holds the logits of the ids
[v0_r, v1_r) only (contiguous shards in rank order that tile [0, V); any sizes, empty ones too).
Neither op needs the [N, V] logits: each shard reduces its columns to a small per-row record, the
records of every shard are merged in shard order, and the rest of the step runs on the merged record
alone, identically on every rank. It is the merge the split-V decode kernel does over its splits
(csrc/include/dinfer_kernels/detail/decode_math.h: `Partial`, `merge`, `finalize_row`), with
ranks as splits.

decode_step (contract: reference/decode.py). A shard's record of row n, RECORD_FIELDS + K fp32 words
(the four integer fields hold int32 bit patterns):

    max, sum        raw max of the sanitised z over the shard and sum exp(z - max) (0 when -inf)
    score, score_z  best score (z, or z / T + gumbel keyed on the *global* id, as the whole row draws
                    it) with credit counted as 0, and the raw z of that token
    nm_score, nm_z  the same over the ids != mask_id
    arg, score_arg, nm_arg   their global ids (lowest on ties; NO_INDEX in an empty shard)
    nonfinite       1 if a raw logit of the shard is NaN or +-inf
    slot_z[K]       the raw z of row n's credit slot ids that fall in the shard (-inf elsewhere)

Merge (any shard order gives the same result; ties go to the lower id): max of the maxima, each sum
rescaled to it and added; each (value, id) pair by larger value, then lower id; nonfinite or-ed;
slot_z by max (each id lies in one shard). Finalize, per row, from the merged record only
(decode_math.h's finalize_row): the credit update of step 2 (the raw top-1 is `arg`, p* = 1 / sum;
a slot's token after the update is its old one or `arg`, whose z is `max`), the fused logits of the
credited tokens (O(K)), the candidate = the better of the pass's best and the credited tokens'
fused scores (fused logits differ from raw ones only there, and only upwards), the fallback likewise,
the fused softmax statistics corrected in O(K), the confidences. Steps 4-6 are decode.commit_rows.
So commits, tokens and credit slot ids are those of decode_step_reference, the confidences and the
credit values equal within rounding (the same correction the compiled kernels make).

soft_embedding (contract: reference/soft_embedding.py). With the row statistics (m, s) of z / tau
(the decode's merged max and sum when tau == 1), a shard's part is

    [t in shard] E_r[t - v0] + [t == mask, live] w * (exp(z_r / tau - m) / s) @ E_r     (fp32)

and the output is the sum of the parts over the shards (one all-reduce of [M, H]).
"""

from typing import List, NamedTuple, Optional, Sequence

import torch

from . import rng
from .decode import DecodeOutput, DecodeParams, _max_sumexp, commit_rows, default_token, sanitize_logits

NO_INDEX = 2**31 - 1  # "no element": loses every tie (decode_math::kNoIndex)
# Record columns: floats, then int32 bit patterns, then the K slot logits.
MAX, SUM, SCORE, SCORE_Z, NM_SCORE, NM_Z, ARG, SCORE_ARG, NM_ARG, NONFINITE = range(10)
RECORD_FIELDS = 10
_NEG_INF = float("-inf")


class VocabParallelDecodeOutput(NamedTuple):
    """decode_step's outputs, plus each row's merged raw statistics of the whole vocabulary:
    row_max = max z, row_sum = sum exp(z - row_max) (what soft_embedding reuses at tau = 1)."""

    candidate: torch.Tensor
    confidence: torch.Tensor
    commit: torch.Tensor
    nonfinite: torch.Tensor
    row_max: torch.Tensor
    row_sum: torch.Tensor


def _ints(record: torch.Tensor) -> torch.Tensor:
    """The integer columns of records [..., F] as int32 (a view: same bits)."""
    return record[..., ARG : NONFINITE + 1].view(torch.int32)


def shard_record(
    logits: torch.Tensor,
    vocab_start: int,
    params: DecodeParams,
    credit_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[N, RECORD_FIELDS + K] fp32 record of the shard logits [N, Vr] holding ids
    [vocab_start, vocab_start + Vr) for the step `params` (module docstring). Allocates [N, Vr] at
    most."""
    N, Vr = logits.shape
    dev = logits.device
    K = 0 if credit_ids is None else credit_ids.shape[1]
    rec = torch.empty(N, RECORD_FIELDS + K, dtype=torch.float32, device=dev)
    ints = _ints(rec)
    if Vr == 0:  # an empty shard: decode_math's empty_partial
        rec[:, :ARG] = _NEG_INF
        rec[:, SUM] = 0.0
        ints[:, :3] = NO_INDEX
        ints[:, 3] = 0
        rec[:, RECORD_FIELDS:] = _NEG_INF
        return rec
    z = sanitize_logits(logits)
    m, s = _max_sumexp(z)
    sampling = params.sampling
    if sampling.temperature > 0:
        g = rng.gumbel(sampling.seed, sampling.offset, N, Vr, dev, sampling.row_keys, vocab_start)
        score = z / sampling.temperature + g
    else:
        score = z
    best = torch.argmax(score, dim=-1, keepdim=True)  # the first of equal maxima: the lowest id
    local_mask = params.mask_id - vocab_start
    if 0 <= local_mask < Vr:
        score_nm = score.clone()
        score_nm[:, local_mask] = _NEG_INF
    else:
        score_nm = score
    nm = torch.argmax(score_nm, dim=-1, keepdim=True)
    rec[:, MAX] = m
    rec[:, SUM] = s
    rec[:, SCORE] = score.gather(1, best)[:, 0]
    rec[:, SCORE_Z] = z.gather(1, best)[:, 0]
    rec[:, NM_SCORE] = score_nm.gather(1, nm)[:, 0]
    rec[:, NM_Z] = z.gather(1, nm)[:, 0]
    ints[:, 0] = (torch.argmax(z, dim=-1) + vocab_start).to(torch.int32)
    ints[:, 1] = (best[:, 0] + vocab_start).to(torch.int32)
    ints[:, 2] = (nm[:, 0] + vocab_start).to(torch.int32)
    ints[:, 3] = (~torch.isfinite(logits).all(dim=-1)).to(torch.int32)
    if K:
        ids = credit_ids.to(torch.int64)
        inside = (ids >= vocab_start) & (ids < vocab_start + Vr)
        at = z.gather(1, (ids - vocab_start).clamp(0, Vr - 1))
        rec[:, RECORD_FIELDS:] = torch.where(inside, at, torch.full_like(at, _NEG_INF))
    return rec


def merge_max_sum(m: torch.Tensor, s: torch.Tensor):
    """Per-row (max, sum exp(. - max)) of partials m, s [R, N] (R shards): the max of the maxima and
    each sum rescaled to it (a shard with max -inf adds 0)."""
    top = m.max(dim=0).values
    safe = torch.where(top == _NEG_INF, torch.zeros_like(top), top)
    part = torch.where(m == _NEG_INF, torch.zeros_like(s), s * torch.exp(m - safe))
    return top, part.sum(dim=0)


def _best(values: torch.Tensor, ids: torch.Tensor, dim: int):
    """(value, id, position along dim) of the larger value, then the lower id, over `dim`."""
    top = values.max(dim=dim, keepdim=True).values
    pick = torch.where(values == top, ids, torch.full_like(ids, NO_INDEX))
    pos = torch.argmin(pick, dim=dim, keepdim=True)
    return top.squeeze(dim), ids.gather(dim, pos).squeeze(dim), pos.squeeze(dim)


def merge_records(records: torch.Tensor) -> torch.Tensor:
    """[N, F] merged record of the shard records [R, N, F] (module docstring)."""
    ints = _ints(records)
    out = torch.empty_like(records[0])
    out_ints = _ints(out)
    out[:, MAX], out[:, SUM] = merge_max_sum(records[:, :, MAX], records[:, :, SUM])
    _, out_ints[:, 0], _ = _best(records[:, :, MAX], ints[:, :, 0], 0)
    for value, z, col in ((SCORE, SCORE_Z, 1), (NM_SCORE, NM_Z, 2)):
        out[:, value], out_ints[:, col], r = _best(records[:, :, value], ints[:, :, col], 0)
        out[:, z] = records[:, :, z].gather(0, r[None])[0]
    out_ints[:, 3] = ints[:, :, 3].amax(dim=0)
    out[:, RECORD_FIELDS:] = records[:, :, RECORD_FIELDS:].amax(dim=0)
    return out


class RowResults(NamedTuple):
    candidate: torch.Tensor  # int64; the mask token on dead rows
    confidence: torch.Tensor  # fp32; 0 on dead rows
    fallback: torch.Tensor  # int64; default_token(mask_id) where none
    fallback_conf: torch.Tensor  # fp32; -inf where none
    fallback_valid: torch.Tensor
    dead: torch.Tensor


def finalize(
    merged: torch.Tensor,
    masked: torch.Tensor,
    vocab: int,
    params: DecodeParams,
    credit_ids: Optional[torch.Tensor] = None,
    credit_vals: Optional[torch.Tensor] = None,
) -> RowResults:
    """Steps 1-3 of every row from its merged record [N, F] (module docstring); updates the credit
    slots in place."""
    N = merged.shape[0]
    mask_id, sampling, credit = params.mask_id, params.sampling, params.credit
    ints = _ints(merged).to(torch.int64)
    m, s = merged[:, MAX], merged[:, SUM]
    arg, score_arg, nm_arg = ints[:, 0], ints[:, 1], ints[:, 2]
    dead = m == _NEG_INF
    K = 0 if credit_ids is None else credit_ids.shape[1]
    if K:
        ids, vals = credit_ids, credit_vals
        empty = (ids < 0) | (ids >= vocab)
        ids.masked_fill_(empty, -1)
        vals.masked_fill_(empty, 0.0)
        vals.mul_(credit.beta)
        before = ids.clone()
        boosted = (masked & ~dead)[:, None]
        boost = ((1.0 / s) ** credit.gamma)[:, None]
        hit = ids == arg[:, None]
        free = ids < 0
        slot = torch.where(
            hit.any(1, keepdim=True),
            torch.argmax(hit.to(torch.int8), dim=1, keepdim=True),
            torch.where(
                free.any(1, keepdim=True),
                torch.argmax(free.to(torch.int8), dim=1, keepdim=True),
                torch.argmin(vals, dim=1, keepdim=True),  # the first of equal minima
            ),
        )
        old = vals.gather(1, slot)
        new = torch.where(hit.any(1, keepdim=True), old + boost, boost)
        vals.scatter_(1, slot, torch.where(boosted, new, old))
        ids.scatter_(1, slot, torch.where(boosted, arg[:, None].to(ids.dtype), ids.gather(1, slot)))
        slot_ids = ids.to(torch.int64)
        live = slot_ids >= 0
        # A slot keeps its token or now holds the raw top-1 `arg`, whose z is the row max.
        z_slot = torch.where(slot_ids == before, merged[:, RECORD_FIELDS:], m[:, None])
        bonus = credit.alpha * torch.log1p(vals)
        zf_slot = torch.where(live, z_slot + bonus, torch.full_like(z_slot, _NEG_INF))
        if sampling.temperature > 0:
            noise = rng.gumbel_at(sampling.seed, sampling.offset, slot_ids, sampling.row_keys)
            score_slot = zf_slot / sampling.temperature + noise
        else:
            score_slot = zf_slot
        slot_key = torch.where(live, slot_ids, torch.full_like(slot_ids, NO_INDEX))
        nm_key = torch.where(slot_ids == mask_id, torch.full_like(slot_key, NO_INDEX), slot_key)
        nm_score_slot = torch.where(nm_key == NO_INDEX, torch.full_like(score_slot, _NEG_INF), score_slot)
    else:
        empty2 = merged.new_empty(N, 0)
        slot_ids = slot_key = nm_key = torch.empty(N, 0, dtype=torch.int64, device=merged.device)
        z_slot = zf_slot = bonus = score_slot = nm_score_slot = empty2
        live = torch.empty(N, 0, dtype=torch.bool, device=merged.device)

    cat = lambda a, b: torch.cat([a[:, None], b], dim=1)
    _, best, _ = _best(cat(merged[:, SCORE], score_slot), cat(score_arg, slot_key), 1)
    _, nm, _ = _best(cat(merged[:, NM_SCORE], nm_score_slot), cat(nm_arg, nm_key), 1)
    fmax = torch.maximum(m, zf_slot.amax(dim=1)) if K else m
    safe_fmax = torch.where(fmax == _NEG_INF, torch.zeros_like(fmax), fmax)
    total = torch.where(dead, torch.zeros_like(s), s * torch.exp(m - safe_fmax))
    if K:
        swap = torch.exp(zf_slot - safe_fmax[:, None]) - torch.exp(z_slot - safe_fmax[:, None])
        total = total + torch.where(live, swap, torch.zeros_like(swap)).sum(dim=1)

    def fused(v, pass_id, pass_z):
        """z' of token v (a credited token or the pass's pick pass_id with raw z pass_z)."""
        match = slot_ids == v[:, None]
        raw = torch.where(match.any(1), (torch.where(match, z_slot, 0.0)).sum(1), pass_z)
        raw = torch.where(match.any(1) | (v == pass_id), raw, torch.full_like(raw, _NEG_INF))
        return raw + torch.where(match, bonus, 0.0).sum(1) if K else raw

    prob = lambda zf: torch.exp(zf - safe_fmax) / total
    conf = prob(fused(best, score_arg, merged[:, SCORE_Z]))
    zf_nm = fused(nm, nm_arg, merged[:, NM_Z])
    fb_valid = (nm != NO_INDEX) & (nm != mask_id) & (zf_nm > _NEG_INF) & ~dead
    fb_conf = torch.where(fb_valid, prob(zf_nm), torch.full_like(conf, _NEG_INF))
    fb = torch.where(fb_valid, nm, torch.full_like(nm, default_token(mask_id)))
    cand = torch.where(dead, torch.full_like(best, mask_id), best)
    conf = torch.where(dead, torch.zeros_like(conf), conf)
    return RowResults(cand, conf, fb, fb_conf, fb_valid, dead)


def decode_step_vocab_parallel_reference(
    shards: Sequence[torch.Tensor],
    tokens: torch.Tensor,
    seq_offsets: torch.Tensor,
    params: DecodeParams,
    *,
    vocab_starts: Optional[Sequence[int]] = None,
    credit_ids=None,
    credit_vals=None,
) -> VocabParallelDecodeOutput:
    """decode_step_reference's step on the logits given as vocabulary shards [N, Vr] in id order
    (vocab_starts: each shard's first id; default: consecutive), in one process: the records, the
    merge and the finalize that dinfer_kernels.decode_step_vocab_parallel runs across ranks. Mutates
    tokens and the credit slots in place."""
    starts = list(vocab_starts) if vocab_starts is not None else _consecutive(shards)
    vocab = starts[-1] + shards[-1].shape[1]
    if credit_ids is not None and credit_ids.shape[1] == 0:
        credit_ids = credit_vals = None
    records = torch.stack([shard_record(z, v0, params, credit_ids) for z, v0 in zip(shards, starts)])
    return finish_step(merge_records(records), tokens, seq_offsets, vocab, params, credit_ids, credit_vals)


def finish_step(
    merged, tokens, seq_offsets, vocab, params: DecodeParams, credit_ids=None, credit_vals=None
) -> VocabParallelDecodeOutput:
    """Steps 1-6 from the merged record [N, F]: what every rank runs after the merge."""
    masked = tokens == params.mask_id
    rows = finalize(merged, masked, vocab, params, credit_ids, credit_vals)
    cand, conf = rows.candidate.clone(), rows.confidence.clone()
    commit = commit_rows(
        cand,
        conf,
        rows.fallback,
        rows.fallback_conf,
        rows.fallback_valid,
        rows.dead,
        masked,
        tokens,
        seq_offsets,
        vocab,
        params,
    )
    nonfinite = _ints(merged)[:, 3] != 0
    return VocabParallelDecodeOutput(
        cand, conf.to(torch.float32), commit, nonfinite, merged[:, MAX].clone(), merged[:, SUM].clone()
    )


def _consecutive(shards: Sequence[torch.Tensor]) -> List[int]:
    starts, v = [], 0
    for z in shards:
        starts.append(v)
        v += z.shape[1]
    return starts


def softmax_stats_shard(logits: torch.Tensor, tau: float):
    """(max, sum exp(. - max)) [M] of the shard's sanitised z / tau (0 and -inf for an empty shard)."""
    if logits.shape[1] == 0:
        M = logits.shape[0]
        return logits.new_full((M,), _NEG_INF, dtype=torch.float32), logits.new_zeros(M, dtype=torch.float32)
    return _max_sumexp(sanitize_logits(logits) / tau)


def soft_embedding_shard(
    logits: torch.Tensor,
    embedding: torch.Tensor,
    tokens: torch.Tensor,
    mask_id: int,
    weight,
    tau: float,
    vocab_start: int,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
) -> torch.Tensor:
    """[M, H] fp32 part of the shard (logits [M, Vr], embedding rows [Vr, H] of ids
    [vocab_start, vocab_start + Vr)) given the row statistics of z / tau over the whole vocabulary
    (module docstring). Summed over the shards and cast to the embedding's dtype: soft_embedding."""
    Vr = logits.shape[1]
    E = embedding.to(torch.float32)
    local = tokens - vocab_start
    inside = (local >= 0) & (local < Vr)
    hard = torch.where(inside[:, None], E[local.clamp(0, max(Vr - 1, 0))], torch.zeros((), device=E.device))
    if Vr == 0:
        return hard
    dead = row_max == _NEG_INF
    z = sanitize_logits(logits) / tau
    safe = torch.where(dead, torch.zeros_like(row_max), row_max)
    p = torch.exp(z - safe[:, None]) / row_sum.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    soft = (tokens == mask_id) & ~dead
    w = torch.as_tensor(weight, dtype=torch.float32, device=logits.device).reshape(-1, 1)
    return hard + torch.where(soft[:, None], w * (p @ E), torch.zeros((), device=E.device))


def soft_embedding_vocab_parallel_reference(
    shards: Sequence[torch.Tensor],
    embeddings: Sequence[torch.Tensor],
    tokens: torch.Tensor,
    mask_id: int,
    weight,
    tau: float = 1.0,
) -> torch.Tensor:
    """soft_embedding_reference on the logits and the embedding given as matching vocabulary shards
    (in id order), in one process: the statistics merged, the parts summed."""
    stats = [softmax_stats_shard(z, tau) for z in shards]
    m, s = merge_max_sum(torch.stack([a for a, _ in stats]), torch.stack([b for _, b in stats]))
    parts = [
        soft_embedding_shard(z, e, tokens, mask_id, weight, tau, v0, m, s)
        for z, e, v0 in zip(shards, embeddings, _consecutive(shards))
    ]
    return torch.stack(parts).sum(0).to(embeddings[0].dtype)


__all__ = [
    "DecodeOutput",
    "RECORD_FIELDS",
    "VocabParallelDecodeOutput",
    "decode_step_vocab_parallel_reference",
    "finalize",
    "finish_step",
    "merge_max_sum",
    "merge_records",
    "shard_record",
    "soft_embedding_shard",
    "soft_embedding_vocab_parallel_reference",
    "softmax_stats_shard",
]
