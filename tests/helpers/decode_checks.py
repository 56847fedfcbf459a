"""The decode_step checks shared by every backend's tests: a backend's step against the fp32 reference
and its fp64 truth (check_backend), and the edge cases each backend must pass (check_*), called by
tests/kernels/test_decode.py for the built backends and by tests/kernels/test_device_logic.py for the
CUDA kernels' logic emulated on the host.

Backend implementations are called directly with poisoned, caller-allocated outputs so an unwritten
element fails. backend_impl is looked up at call time: test_device_logic patches it (in this module)
to add its emulated backend.
"""

import importlib

import torch
from conftest import assert_precision

from dinfer_kernels import op_inputs
from dinfer_kernels.reference import decode_params, decode_step_reference

RULES = ("threshold", "hierarchical", "fixed", "joint")
# The joint rule's edit threshold in the generic checks (check_backend): low enough that random rows
# of every vocabulary edit, so that each check of the joint rule also exercises its edits.
JOINT_EDIT_AT = 0.1


def small_vocab(backend, device):
    """The Triton interpreter is slow: keep its vocabularies small."""
    return backend == "triton" and device == "cpu"


def backend_impl(backend):
    if backend == "torch":
        return None
    return importlib.import_module(f"dinfer_kernels.{backend}.decode").decode_step


def run_backend(
    backend,
    device,
    logits,
    tokens,
    offsets,
    mask_id,
    rule,
    threshold,
    num_commit,
    credit,
    temperature=0.0,
    seed=0,
    offset=0,
    row_keys=None,
    editable=None,
    edit_threshold=None,
):
    """One call on `device`; returns outputs and the updated tokens / credit on the host.
    edit_threshold None is editing off: the reference's None, the kernels' +inf."""
    N = logits.shape[0]
    to = lambda t: t.to(device)
    lg, tok, offs = to(logits), to(tokens.clone()), to(offsets)
    keys = None if row_keys is None else to(row_keys)
    edit = None if editable is None else to(editable)
    ids, vals = (
        (to(credit[0].clone()), to(credit[1].clone()))
        if credit
        else (torch.empty(N, 0, dtype=torch.int32, device=device), torch.empty(N, 0, device=device))
    )
    if backend == "torch":
        out = decode_step_reference(
            lg,
            tok,
            offs,
            decode_params(
                mask_id,
                rule=rule,
                threshold=to(threshold),
                num_commit=to(num_commit),
                temperature=temperature,
                seed=seed,
                offset=offset,
                row_keys=keys,
                editable=edit,
                edit_threshold=edit_threshold,
            ),
            credit_ids=ids if credit else None,
            credit_vals=vals if credit else None,
        )
        outs = list(out)
    else:
        outs = [
            torch.full((N,), -7, dtype=torch.int64, device=device),
            torch.full((N,), float("nan"), device=device),
            torch.ones(N, dtype=torch.bool, device=device)
            if N % 2
            else torch.zeros(N, dtype=torch.bool, device=device),
            torch.zeros(N, dtype=torch.bool, device=device)
            if N % 2
            else torch.ones(N, dtype=torch.bool, device=device),
        ]
        params = decode_params(
            mask_id,
            rule=rule,
            threshold=to(threshold),
            num_commit=to(num_commit),
            temperature=temperature,
            seed=seed,
            offset=offset,
            row_keys=keys,
            editable=edit,
            edit_threshold=edit_threshold,
        )
        backend_impl(backend)(lg, tok, offs, ids, vals, *outs, params)
    host = lambda t: t.cpu()
    return [host(o) for o in outs], host(tok), (host(ids), host(vals))


def check_backend(
    backend,
    device,
    logits,
    tokens,
    offsets,
    mask_id,
    rule="threshold",
    threshold=None,
    num_commit=None,
    credit=None,
    iterations=1,
    fresh_logits=None,
    **kw,
):
    """Runs `iterations` steps on the backend and on the fp32 / fp64 references, comparing each.
    The joint rule edits above JOINT_EDIT_AT unless kw says otherwise (edit_threshold=None: off)."""
    if rule == "joint":
        kw.setdefault("edit_threshold", JOINT_EDIT_AT)
    B = offsets.numel() - 1
    threshold = torch.rand(B) if threshold is None else threshold
    num_commit = torch.randint(0, 4, (B,), dtype=torch.int32) if num_commit is None else num_commit
    tok_b, tok_r, tok_t = tokens.clone(), tokens.clone(), tokens.clone()
    cred_b = cred_r = cred_t = credit
    for it in range(iterations):
        if it and fresh_logits is not None:
            logits = fresh_logits()
        outs, tok_b2, cred_b2 = run_backend(
            backend, device, logits, tok_b, offsets, mask_id, rule, threshold, num_commit, cred_b, **kw
        )
        ref, tok_r2, cred_r2 = run_backend(
            "torch", "cpu", logits, tok_r, offsets, mask_id, rule, threshold, num_commit, cred_r, **kw
        )
        truth_tok = tok_t.clone()
        truth_cred = (cred_t[0].clone(), cred_t[1].clone()) if cred_t else (None, None)
        truth = decode_step_reference(
            logits,
            truth_tok,
            offsets,
            decode_params(mask_id, rule=rule, threshold=threshold, num_commit=num_commit, **kw),
            credit_ids=truth_cred[0],
            credit_vals=truth_cred[1],
            compute_dtype=torch.float64,
        )
        cand, conf, commit, nonfinite = outs
        assert torch.equal(cand, ref[0]), f"iteration {it}: candidates differ"
        assert torch.equal(nonfinite, ref[3]), f"iteration {it}: non-finite flags differ"
        assert torch.equal(commit, ref[2]), f"iteration {it}: commit masks differ"
        assert torch.equal(tok_b2, tok_r2), f"iteration {it}: updated tokens differ"
        assert_precision(conf, ref[1], truth.confidence.double(), "confidence")
        if credit:
            assert torch.equal(cred_b2[0], cred_r2[0]), f"iteration {it}: credit slot ids differ"
            assert_precision(cred_b2[1], cred_r2[1], truth_cred[1].double(), "credit values")
        tok_b, tok_r, tok_t = tok_b2, tok_r2, truth_tok
        cred_b, cred_r, cred_t = cred_b2, cred_r2, (cred_r2 if credit else None)
    return outs


def make_case(N, V, offsets, dtype=torch.float32, mask_id=None, masked_frac=0.7, scale=3.0):
    a = op_inputs.decode_step_inputs(
        N, V, dtype=dtype, seq_offsets=offsets, mask_id=mask_id, masked_frac=masked_frac, scale=scale
    )
    return a["logits"], a["tokens"], a["seq_offsets"], a["mask_id"]


def ragged_offsets(N, B):
    cuts = sorted(torch.randint(0, N + 1, (B - 1,)).tolist())
    return [0] + cuts + [N]


def check_shapes_and_rules(backend, device, rule, N, V):
    logits, tokens, offsets, mask_id = make_case(N, V, ragged_offsets(N, min(N, 3)))
    check_backend(backend, device, logits, tokens, offsets, mask_id, rule)


def check_dtypes_and_row_stride(backend, device, dtype):
    V = 1000 if small_vocab(backend, device) else 5003
    full = (torch.randn(9, V + 13) * 4).to(dtype)
    logits = full[:, 5 : V + 5]  # row stride V + 13, unaligned start: vector loads must cope
    _, tokens, offsets, mask_id = make_case(9, V, [0, 2, 2, 9])
    for rule in RULES:
        check_backend(backend, device, logits, tokens, offsets, mask_id, rule)


def check_ties_pick_lowest_index(backend, device):
    # Small integer logits: many exact ties in the max and in the confidences.
    V = 97
    logits = torch.randint(0, 3, (24, V)).float()
    _, tokens, offsets, mask_id = make_case(24, V, [0, 8, 16, 24], masked_frac=1.0)
    for rule in RULES:
        outs = check_backend(
            backend, device, logits, tokens, offsets, mask_id, rule, threshold=torch.full((3,), 0.01)
        )
    first_max = logits.argmax(-1)  # torch's argmax returns the first maximal index
    assert bool(((outs[0] == first_max) | (first_max == mask_id)).all())


def check_inf_nan_and_dead_rows(backend, device):
    V = 301
    logits, tokens, offsets, mask_id = make_case(8, V, [0, 4, 8], masked_frac=1.0)
    logits[0, 10] = float("inf")
    logits[0, 20] = float("inf")  # two +inf: tie at FLT_MAX, lowest index wins, p = 1/2
    logits[1, :] = float("-inf")  # dead row: candidate mask_id, confidence 0
    logits[2, ::2] = float("nan")  # NaN counts as -inf
    logits[3, :] = float("nan")  # all NaN: dead
    logits[5, 7] = float("-inf")
    outs = check_backend(
        backend, device, logits, tokens, offsets, mask_id, "threshold", threshold=torch.tensor([0.3, 0.9])
    )
    cand, conf, commit, _ = outs
    assert int(cand[0]) == 10 and abs(float(conf[0]) - 0.5) < 1e-6
    for dead in (1, 3):
        assert int(cand[dead]) == mask_id and float(conf[dead]) == 0.0 and not bool(commit[dead])


def check_no_mask_all_mask_and_mask_predictions(backend, device, rule):
    V = 211
    logits, tokens, offsets, mask_id = make_case(12, V, [0, 5, 12])
    # no masked position at all: nothing commits, but the joint rule's edits
    unmasked = torch.where(tokens == mask_id, torch.zeros_like(tokens), tokens)
    cand, conf, commit, _ = check_backend(backend, device, logits, unmasked, offsets, mask_id, rule)
    edits = (cand != unmasked) & (cand != mask_id) & (conf > JOINT_EDIT_AT)
    assert torch.equal(commit, edits if rule == "joint" else torch.zeros_like(commit))
    # every position masked
    check_backend(backend, device, logits, torch.full_like(tokens, mask_id), offsets, mask_id, rule)
    # every masked position predicts the mask token: the progress guarantee commits exactly one
    # token per sequence, the best non-mask token of the most confident position
    biased = logits.clone()
    biased[:, mask_id] = 50.0
    all_masked = torch.full_like(tokens, mask_id)
    outs = check_backend(
        backend,
        device,
        biased,
        all_masked,
        offsets,
        mask_id,
        rule,
        num_commit=torch.tensor([2, 3], dtype=torch.int32),
    )
    cand, commit = outs[0], outs[2]
    assert commit[:5].sum() == 1 and commit[5:].sum() == 1
    second = biased.clone()
    second[:, mask_id] = float("-inf")
    for lo, hi in ((0, 5), (5, 12)):
        row = lo + int(torch.nonzero(commit[lo:hi])[0])
        assert int(cand[row]) == int(second[row].argmax()) != mask_id
        best = torch.softmax(biased[lo:hi].double(), -1).gather(1, second[lo:hi].argmax(-1, keepdim=True))
        assert row == lo + int(best.argmax())


def check_credit_over_a_block(backend, device, slots, rule):
    """Credit builds up over a block's iterations; under the joint rule the committed rows of the
    block are edited in later ones (their candidates use the credit-fused logits too)."""
    V = 503 if small_vocab(backend, device) else 32003
    N = 10
    logits, tokens, offsets, mask_id = make_case(N, V, [0, 4, 10], masked_frac=1.0, scale=1.5)
    credit = (torch.full((N, slots), -1, dtype=torch.int32), torch.zeros(N, slots))
    check_backend(
        backend,
        device,
        logits,
        tokens,
        offsets,
        mask_id,
        rule,
        credit=credit,
        threshold=torch.tensor([0.9, 0.95]),
        iterations=8,
        fresh_logits=lambda: torch.randn(N, V) * 1.5,
        **({"edit_threshold": 0.002} if rule == "joint" else {}),
    )


def check_sampling_matches_reference(backend, device, rule):
    V = 777
    logits, tokens, offsets, mask_id = make_case(16, V, [0, 7, 16], scale=1.0)
    credit = (torch.full((16, 4), -1, dtype=torch.int32), torch.zeros(16, 4))
    check_backend(
        backend,
        device,
        logits,
        tokens,
        offsets,
        mask_id,
        rule,
        credit=credit,
        temperature=0.7,
        seed=123,
        offset=9,
        iterations=2,
        fresh_logits=lambda: torch.randn(16, V),
    )


def check_sampling_reproducible_per_seed(backend, device):
    V = 401
    logits, tokens, offsets, mask_id = make_case(32, V, [0, 32], scale=0.5)
    args = (
        backend,
        device,
        logits,
        tokens,
        offsets,
        mask_id,
        "threshold",
        torch.tensor([0.5]),
        torch.zeros(1, dtype=torch.int32),
        None,
    )
    a = run_backend(*args, temperature=1.0, seed=7, offset=3)[0][0]
    b = run_backend(*args, temperature=1.0, seed=7, offset=3)[0][0]
    c = run_backend(*args, temperature=1.0, seed=8, offset=3)[0][0]
    d = run_backend(*args, temperature=1.0, seed=7, offset=4)[0][0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def check_many_sequences_and_empty_ones(backend, device):
    V = 127
    N = 40
    offsets = [0, 0, 1, 1, 9, 9, 9, 25, 40, 40]
    logits, tokens, offs, mask_id = make_case(N, V, offsets)
    for rule in RULES:
        check_backend(backend, device, logits, tokens, offs, mask_id, rule)


# ---- the joint rule (LLaDA2.1's JointThreshold): the threshold rule plus token-to-token edits -----

JOINT_PEAK = 15.0  # a token this far above the rest holds >= 0.95 of the mass even at V = 157184


def joint_case(V, dtype=torch.float32):
    """14 rows over V tokens (mask V - 1) in sequences [], rows 0-7 (no [MASK]: a post-edit step, only
    edits can happen), [] and rows 8-13 (mixed), with every kind of row the edit condition tells
    apart. Returns (logits, tokens, offsets, mask_id, editable, rows that commit and their tokens)
    for tau 0.9 and edit_threshold 0.6."""
    mask_id = V - 1
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(14, V, generator=g) * 0.1
    tokens = torch.tensor([5, 5, 7, 5, 5, 5, 5, 5, mask_id, mask_id, 3, 3, mask_id, 4])
    editable = torch.ones(14, dtype=torch.bool)
    peaks = {0: 7, 2: 7, 3: mask_id, 6: 9, 7: 8, 8: 11, 10: 12, 11: 12, 12: mask_id, 13: 4}
    for row, tok in peaks.items():
        logits[row, tok] += JOINT_PEAK
    logits[1, 7] += 1.0  # row 1: another token, far below the edit threshold
    logits[4] = float("-inf")  # row 4: dead
    logits[5] = float("nan")  # row 5: dead (NaN everywhere)
    logits[7, ::3] = float("nan")  # row 7: NaN in places, live; its peak (8) is not one of them
    editable[[6, 11]] = False  # rows 6 and 11: confident in another token, but not editable
    # commits: rows 0 and 7 (edits), 8 (tau), 10 (edit); not 2 and 13 (their own token), 3 and 12
    # (the mask token), 9 (not confident, and 8 commits), 1 (below the edit threshold)
    commits = {0: 7, 7: 8, 8: 11, 10: 12}
    offsets = torch.tensor([0, 0, 8, 8, 14], dtype=torch.int32)
    return logits.to(dtype), tokens, offsets, mask_id, editable, commits


def check_joint_commits_and_edits(backend, device, V, dtype, temperature):
    """Edits: committed, editable, live rows whose candidate is neither the mask nor their token,
    above edit_threshold; with the threshold rule on the masked rows, in a block with and one
    without [MASK]; greedy and sampled candidates."""
    logits, tokens, offsets, mask_id, editable, commits = joint_case(V, dtype)
    threshold = torch.full((4,), 0.9)
    cand, _, commit, nonfinite = check_backend(
        backend,
        device,
        logits,
        tokens,
        offsets,
        mask_id,
        "joint",
        threshold=threshold,
        editable=editable,
        edit_threshold=0.6,
        temperature=temperature,
        seed=3,
    )
    assert commit.nonzero().flatten().tolist() == sorted(commits)
    assert cand[sorted(commits)].tolist() == [commits[r] for r in sorted(commits)]
    assert nonfinite.nonzero().flatten().tolist() == [4, 5, 7]
    # editing off (the kernels' +inf): the threshold rule's commits, row for row
    off = check_backend(
        backend, device, logits, tokens, offsets, mask_id, "joint", threshold=threshold, edit_threshold=None
    )
    same = check_backend(backend, device, logits, tokens, offsets, mask_id, "threshold", threshold=threshold)
    assert all(torch.equal(a, b) for a, b in zip(off, same)) and off[2].nonzero().flatten().tolist() == [8]


def check_joint_edit_threshold_is_strict(backend, device):
    """A confidence exactly at edit_threshold is not an edit (`>`); one fp32 step below it is. Uniform
    rows over 8 tokens: candidate 0 (the lowest index), confidence exactly 1/8 on every backend."""
    V, mask_id = 8, 7
    logits = torch.zeros(6, V)
    tokens = torch.tensor([3, 3, mask_id, 0, 5, 3])  # row 3 holds its candidate already
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    below = float(torch.tensor(0.125).nextafter(torch.tensor(0.0)))
    for edit_at, edited in ((0.125, []), (below, [0, 1, 4, 5])):
        cand, conf, commit, _ = check_backend(
            backend, device, logits, tokens, offsets, mask_id, "joint", edit_threshold=edit_at
        )
        assert conf.tolist() == [0.125] * 6 and cand.tolist() == [0] * 6
        assert commit.nonzero().flatten().tolist() == sorted(edited + [2])  # row 2: its sequence's M2T


def check_joint_only_masks_is_the_threshold_rule(backend, device):
    """Without a committed row there is nothing to edit: the threshold rule's outputs, also the
    progress guarantee's (every masked row predicting the mask token)."""
    V = 211 if small_vocab(backend, device) else 5003
    logits, tokens, offsets, mask_id = make_case(20, V, [0, 0, 7, 20], masked_frac=1.0)
    threshold = torch.tensor([0.5, 0.2, 0.95])
    for lg in (logits, logits.index_fill(1, torch.tensor([mask_id]), 60.0)):
        joint = check_backend(backend, device, lg, tokens, offsets, mask_id, "joint", threshold=threshold)
        plain = check_backend(backend, device, lg, tokens, offsets, mask_id, "threshold", threshold=threshold)
        assert all(torch.equal(a, b) for a, b in zip(joint, plain)) and joint[2].any()


def check_joint_never_edits_the_prompt_tail(backend, device):
    """LLaDA2's first block: its first rows are the prompt's tail (not editable), the rest are
    generated. Over a block's steps and then post-edit steps, with every row confident in a new
    token each step, the prompt rows keep their tokens and the generated rows are rewritten."""
    V, N, tail = (97 if small_vocab(backend, device) else 4099), 9, 3
    mask_id = V - 1
    tokens = torch.full((N,), mask_id)
    prompt = torch.tensor([11, 12, 13])
    tokens[:tail] = prompt
    editable = torch.arange(N) >= tail
    offsets = torch.tensor([0, N], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    edited = torch.zeros(N, dtype=torch.bool)
    for step in range(N):
        logits = torch.randn(N, V, generator=g)
        logits[torch.arange(N), torch.randint(0, V - 1, (N,), generator=g)] += JOINT_PEAK
        masked = tokens == mask_id
        cand, _, commit, _ = check_backend(
            backend, device, logits, tokens, offsets, mask_id, "joint", editable=editable, edit_threshold=0.5
        )
        assert not commit[:tail].any(), f"step {step}: a prompt row was rewritten"
        edited |= commit & ~masked
        tokens = torch.where(commit, cand, tokens)
    assert torch.equal(tokens[:tail], prompt) and not (tokens == mask_id).any()
    assert edited[tail:].any()


def check_sequences_without_any_fallback_commit_the_default_token(backend, device, rule, mask_id, dtype):
    """Step 5's last resort: when no masked row of a sequence has a fallback (NaN weights make every
    row dead), the lowest masked row commits the lowest non-mask id with confidence 0, so a block
    still ends; a sequence with a real fallback somewhere keeps it."""
    V = 37
    default = 1 if mask_id == 0 else 0
    logits = torch.randn(12, V)
    tokens = torch.full((12,), mask_id)
    logits[0:3] = float("nan")  # sequence 0: all NaN
    logits[3:6] = float("-inf")  # sequence 1: all -inf
    tokens[6] = 9  # sequence 2: an unmasked row first, then
    logits[7] = float("-inf")
    logits[7, mask_id] = 2.0  # only the mask token finite: no fallback
    logits[8] = float("nan")
    logits[8, mask_id] = float("inf")
    logits[9:12] = float("nan")  # sequence 3: dead rows and one that
    logits[10, mask_id] = 40.0  # predicts the mask with a real fallback
    logits[10, 3] = 1.0
    offsets = torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32)
    cand, conf, commit, nonfinite = check_backend(
        backend,
        device,
        logits.to(dtype),
        tokens,
        offsets,
        mask_id,
        rule,
        num_commit=torch.tensor([1, 2, 0, 3], dtype=torch.int32),
    )
    # row 6 (unmasked, live) is the joint rule's to edit, when confident in another token
    edited = rule == "joint" and int(cand[6]) not in (9, mask_id) and float(conf[6]) > JOINT_EDIT_AT
    assert commit.nonzero().flatten().tolist() == [0, 3] + [6] * edited + [7, 10]
    assert cand[[0, 3, 7]].tolist() == [default] * 3 and conf[[0, 3, 7]].tolist() == [0.0] * 3
    assert int(cand[10]) == 3 and float(conf[10]) > 0.0
    assert nonfinite.tolist() == [True] * 6 + [False, True, True, True, True, True]


def check_nonfinite_flags(backend, device, dtype):
    """nonfinite[n]: a NaN or +-inf anywhere in raw row n, wherever it sits (vector body, scalar
    tail, the mask token, a later vocabulary split); sanitising must not hide it."""
    V = 1000 if small_vocab(backend, device) else 5003
    logits, tokens, offsets, mask_id = make_case(10, V, [0, 4, 10], dtype=dtype)
    spots = {
        1: (3, float("nan")),
        2: (V - 1, float("inf")),
        3: (V // 2, float("-inf")),
        5: (mask_id, float("nan")),
        6: (V - 3, float("-inf")),
        8: (17, float("inf")),
    }
    for row, (v, x) in spots.items():
        logits[row, v] = x
    logits[9] = float("nan")
    outs = check_backend(backend, device, logits, tokens, offsets, mask_id, "threshold")
    assert outs[3].nonzero().flatten().tolist() == sorted([*spots, 9])


def check_row_keys_key_the_noise(backend, device):
    """Sampling noise follows row_keys, not row indices: rows moved together with their keys sample
    the same tokens; no keys is keys = row indices; keys use their low 32 bits."""
    V, N = 301, 12
    logits, tokens, _, mask_id = make_case(N, V, [0, N], masked_frac=1.0, scale=0.5)
    offsets = torch.arange(N + 1, dtype=torch.int32)  # one row per sequence: order-free
    keys = torch.randint(0, 2**32, (N,), dtype=torch.int64)
    kw = dict(temperature=2.0, seed=5, offset=1)
    base = check_backend(backend, device, logits, tokens, offsets, mask_id, row_keys=keys, **kw)[0]
    perm = torch.randperm(N)
    moved = check_backend(
        backend, device, logits[perm], tokens[perm], offsets, mask_id, row_keys=keys[perm] + (3 << 32), **kw
    )[0]
    assert torch.equal(moved, base[perm])
    plain = check_backend(backend, device, logits, tokens, offsets, mask_id, **kw)[0]
    indexed = check_backend(
        backend, device, logits, tokens, offsets, mask_id, row_keys=torch.arange(N), **kw
    )[0]
    assert torch.equal(plain, indexed) and not torch.equal(plain, base)
