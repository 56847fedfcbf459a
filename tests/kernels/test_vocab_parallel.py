"""The vocabulary-parallel forms of decode_step and soft_embedding (reference/vocab_parallel.py), in one
process: the shard records merged over any split of the vocabulary give decode_step's step (commits,
tokens, credit slot ids exactly; confidences and credit values within precision) and
soft_embedding's output. The same functions across ranks of a process group:
tests/engine/test_parallel.py."""

import pytest
import torch
from conftest import assert_precision

from dinfer_kernels.reference import decode_params, decode_step_reference, soft_embedding_reference
from dinfer_kernels.reference import vocab_parallel as vp

RULES = ("threshold", "hierarchical", "fixed", "joint")


def cuts(V, parts, gen):
    """`parts` contiguous shards of [0, V) at random places (empty ones allowed)."""
    inner = sorted(torch.randint(0, V + 1, (parts - 1,), generator=gen).tolist())
    bounds = [0, *inner, V]
    return list(zip(bounds, bounds[1:]))


def random_case(gen, N, V, K, ties=False, nonfinite=False):
    mask_id = int(torch.randint(0, V, (), generator=gen))
    logits = torch.randn(N, V, generator=gen) * 3
    if ties:  # many equal values, equal maxima in different shards
        logits = logits.round()
    if nonfinite and N > 2:
        logits[0, ::3] = float("nan")
        logits[1] = float("-inf")  # a dead row
        logits[2, 1] = float("inf")
    tokens = torch.randint(0, V, (N,), generator=gen)
    tokens[torch.rand(N, generator=gen) < 0.7] = mask_id
    B = int(torch.randint(1, 4, (), generator=gen))
    offsets = torch.tensor([0, *sorted(torch.randint(0, N + 1, (B - 1,), generator=gen).tolist()), N])
    ids = torch.full((N, K), -1, dtype=torch.int32)
    vals = torch.zeros(N, K)
    if K:
        used = min(K, V)
        ids[:, :used] = torch.stack([torch.randperm(V, generator=gen)[:used] for _ in range(N)]).int()
        ids[torch.rand(N, K, generator=gen) < 0.3] = -1
        vals = torch.where(ids >= 0, torch.rand(N, K, generator=gen), torch.zeros(()))
        if K > 1:
            ids[0, -1] = V + 5  # an unchecked bad id: an empty slot
    return logits, tokens, offsets.to(torch.int32), mask_id, (ids, vals)


def run_both(logits, tokens, offsets, mask_id, credit, shards, **kw):
    """(reference, vocab-parallel, fp64 truth) outputs, each with its updated tokens and credit."""
    runs = []
    for how in ("whole", "shards", "truth"):
        tok = tokens.clone()
        ids, vals = (credit[0].clone(), credit[1].clone()) if credit[0].shape[1] else (None, None)
        if how == "shards":
            out = vp.decode_step_vocab_parallel_reference(
                [logits[:, a:b] for a, b in shards],
                tok,
                offsets,
                decode_params(mask_id, **kw),
                vocab_starts=[a for a, _ in shards],
                credit_ids=ids,
                credit_vals=vals,
            )
        else:
            extra = dict(compute_dtype=torch.float64) if how == "truth" else {}
            out = decode_step_reference(
                logits, tok, offsets, decode_params(mask_id, **kw), credit_ids=ids, credit_vals=vals, **extra
            )
        runs.append((out, tok, (ids, vals)))
    return runs


def assert_same_step(runs, credit):
    (ref, ref_tok, ref_cred), (got, tok, cred), (truth, _, truth_cred) = runs
    assert torch.equal(got.candidate, ref.candidate)
    assert torch.equal(got.commit, ref.commit)
    assert torch.equal(got.nonfinite, ref.nonfinite)
    assert torch.equal(tok, ref_tok)
    assert_precision(got.confidence, ref.confidence, truth.confidence.double(), "confidence")
    if credit:
        assert torch.equal(cred[0], ref_cred[0])
        assert_precision(cred[1], ref_cred[1], truth_cred[1].double(), "credit values")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("K", [0, 4])
def test_sharded_step_equals_decode_step(rule, temperature, K):
    gen = torch.Generator().manual_seed(100 * RULES.index(rule) + 10 * int(temperature * 10) + K)
    for trial in range(12):
        N = int(torch.randint(1, 17, (), generator=gen))
        V = int(torch.randint(2, 90, (), generator=gen))
        parts = int(torch.randint(1, 6, (), generator=gen))
        case = random_case(gen, N, V, K, ties=trial % 3 == 0, nonfinite=trial % 4 == 1)
        logits, tokens, offsets, mask_id, credit = case
        B = offsets.numel() - 1
        kw = dict(
            rule=rule,
            threshold=torch.rand(B, generator=gen),
            num_commit=torch.randint(0, 4, (B,), dtype=torch.int32, generator=gen),
            temperature=temperature,
            seed=7,
            offset=trial,
            row_keys=torch.randint(0, 2**40, (N,), generator=gen) if trial % 2 else None,
        )
        if rule == "joint":
            kw.update(edit_threshold=0.3, editable=torch.rand(N, generator=gen) < 0.5)
        runs = run_both(logits, tokens, offsets, mask_id, credit, cuts(V, parts, gen), **kw)
        assert_same_step(runs, K > 0)


def test_ties_across_shard_boundaries_pick_the_lowest_id():
    N, V = 6, 40
    logits = torch.zeros(N, V)
    logits[:, [3, 17, 35]] = 5.0  # equal maxima in three shards
    tokens = torch.full((N,), 20)
    offsets = torch.tensor([0, N], dtype=torch.int32)
    shards = [(0, 10), (10, 20), (20, 30), (30, 40)]
    credit = (torch.full((N, 2), -1, dtype=torch.int32), torch.zeros(N, 2))
    runs = run_both(logits, tokens, offsets, 20, credit, shards, threshold=torch.tensor([0.0]))
    assert_same_step(runs, True)
    assert runs[1][0].candidate.tolist() == [3] * N
    assert runs[1][2][0][:, 0].tolist() == [3] * N  # the credit went to the lowest of the tied ids


def test_real_vocabulary_split_unevenly():
    gen = torch.Generator().manual_seed(3)
    V = 157184
    logits, tokens, offsets, mask_id, credit = random_case(gen, 5, V, 8)
    shards = cuts(V, 3, gen)
    for temperature in (0.0, 1.0):
        runs = run_both(logits, tokens, offsets, mask_id, credit, shards, temperature=temperature, seed=1)
        assert_same_step(runs, True)


def test_records_merge_in_any_order():
    gen = torch.Generator().manual_seed(5)
    logits, tokens, offsets, mask_id, (ids, _) = random_case(gen, 9, 50, 3, ties=True)
    shards = cuts(50, 4, gen)
    recs = torch.stack(
        [vp.shard_record(logits[:, a:b], a, decode_params(mask_id, temperature=0.5), ids) for a, b in shards]
    )
    merged = vp.merge_records(recs)
    for perm in (torch.tensor([3, 1, 0, 2]), torch.tensor([2, 3, 1, 0])):
        other = vp.merge_records(recs[perm])
        ints = slice(vp.ARG, vp.NONFINITE + 1)
        assert torch.equal(other[:, ints].view(torch.int32), merged[:, ints].view(torch.int32))
        assert torch.allclose(other, merged, equal_nan=True)


@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_sharded_soft_embedding_equals_soft_embedding(tau):
    gen = torch.Generator().manual_seed(11)
    M, V, H = 13, 61, 24
    logits = torch.randn(M, V, generator=gen) * 2
    logits[0] = float("-inf")  # a dead masked row: its hard embedding only
    logits[1, 5] = float("nan")
    E = torch.randn(V, H, generator=gen)
    tokens = torch.randint(0, V, (M,), generator=gen)
    tokens[::2] = 7
    w = torch.rand(M, generator=gen)
    shards = cuts(V, 4, gen)
    got = vp.soft_embedding_vocab_parallel_reference(
        [logits[:, a:b] for a, b in shards], [E[a:b] for a, b in shards], tokens, 7, w, tau
    )
    same = soft_embedding_reference(logits, E, tokens, 7, w, tau)
    truth = soft_embedding_reference(logits, E, tokens, 7, w, tau, compute_dtype=torch.float64)
    assert_precision(got, same, truth, "soft embedding")
