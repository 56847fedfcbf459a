"""Every decode_step backend against the reference (dinfer_kernels/reference/decode.py).

Backend implementations are called directly with poisoned, caller-allocated outputs so an unwritten
element fails; the public op is tested in test_decode_api.py.
"""

import importlib

import pytest
import torch
from conftest import assert_precision, device_backends

from dinfer_kernels import op_inputs
from dinfer_kernels.reference import decode_params, decode_step_reference

RULES = ("threshold", "hierarchical", "fixed", "joint")
# The joint rule's edit threshold in the generic checks (check_backend): low enough that random rows
# of every vocabulary edit, so that each check of the joint rule also exercises its edits.
JOINT_EDIT_AT = 0.1
BACKENDS = device_backends()
pytestmark = pytest.mark.usefixtures("host_isa")  # the host kernels under every ISA this CPU runs


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


def shape_cases():
    """(backend, device, rule, N, V): every backend and rule on small vocabularies; the large ones
    (32003, the real 157184) for compiled backends, and for the interpreter only on the GPU."""
    sizes = [(1, 1), (3, 7), (64, 1000), (3, 32003), (64, 32003), (1, 157184), (64, 157184)]
    for backend, device in BACKENDS:
        for rule in RULES:
            for N, V in sizes:
                if V > 1000 and (
                    small_vocab(backend, device) or (backend == "torch" and rule != "threshold")
                ):
                    continue
                yield backend, device, rule, N, V


@pytest.mark.parametrize("backend,device,rule,N,V", list(shape_cases()))
def test_shapes_and_rules(backend, device, rule, N, V):
    logits, tokens, offsets, mask_id = make_case(N, V, ragged_offsets(N, min(N, 3)))
    check_backend(backend, device, logits, tokens, offsets, mask_id, rule)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_and_row_stride(backend, device, dtype):
    V = 1000 if small_vocab(backend, device) else 5003
    full = (torch.randn(9, V + 13) * 4).to(dtype)
    logits = full[:, 5 : V + 5]  # row stride V + 13, unaligned start: vector loads must cope
    _, tokens, offsets, mask_id = make_case(9, V, [0, 2, 2, 9])
    for rule in RULES:
        check_backend(backend, device, logits, tokens, offsets, mask_id, rule)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_ties_pick_lowest_index(backend, device):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_inf_nan_and_dead_rows(backend, device):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_no_mask_all_mask_and_mask_predictions(backend, device, rule):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("slots", [4, 16])
@pytest.mark.parametrize("rule", ["threshold", "joint"])
def test_credit_over_a_block(backend, device, slots, rule):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_sampling_matches_reference(backend, device, rule):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_sampling_reproducible_per_seed(backend, device):
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


def test_sampling_follows_softmax():
    """Gumbel-max with the counter-based noise samples softmax(z / T): frequencies over many rows."""
    V, rows, T = 6, 20000, 0.8
    z = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 1.5])
    logits = z.expand(rows, V).contiguous()
    tokens = torch.zeros(rows, dtype=torch.int64)
    out = decode_step_reference(
        logits,
        tokens,
        torch.tensor([0, rows], dtype=torch.int32),
        decode_params(0, threshold=torch.tensor([2.0]), temperature=T, seed=11),
    )
    freq = torch.bincount(out.candidate, minlength=V).double() / rows
    p = torch.softmax(z.double() / T, -1)
    assert (freq - p).abs().max() < 4 * (p * (1 - p) / rows).sqrt().max()


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_many_sequences_and_empty_ones(backend, device):
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


def joint_vocabularies(backend, device):
    return [41, 1000] if small_vocab(backend, device) else [41, 32003, 157184]


def joint_cases():
    for backend, device in BACKENDS:
        for V in joint_vocabularies(backend, device):
            yield backend, device, V


@pytest.mark.parametrize("backend,device,V", list(joint_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_joint_commits_and_edits(backend, device, V, dtype, temperature):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_joint_edit_threshold_is_strict(backend, device):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_joint_only_masks_is_the_threshold_rule(backend, device):
    """Without a committed row there is nothing to edit: the threshold rule's outputs, also the
    progress guarantee's (every masked row predicting the mask token)."""
    V = 211 if small_vocab(backend, device) else 5003
    logits, tokens, offsets, mask_id = make_case(20, V, [0, 0, 7, 20], masked_frac=1.0)
    threshold = torch.tensor([0.5, 0.2, 0.95])
    for lg in (logits, logits.index_fill(1, torch.tensor([mask_id]), 60.0)):
        joint = check_backend(backend, device, lg, tokens, offsets, mask_id, "joint", threshold=threshold)
        plain = check_backend(backend, device, lg, tokens, offsets, mask_id, "threshold", threshold=threshold)
        assert all(torch.equal(a, b) for a, b in zip(joint, plain)) and joint[2].any()


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_joint_never_edits_the_prompt_tail(backend, device):
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


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_bf16_large_batch(backend):
    if (backend, "cuda") not in BACKENDS:
        pytest.skip(f"{backend} not built/available")
    logits, tokens, offsets, mask_id = make_case(512, 157184, ragged_offsets(512, 8), torch.bfloat16)
    for rule in RULES:
        check_backend(backend, "cuda", logits, tokens, offsets, mask_id, rule)


# ---- unchecked values on the GPU backends (no host sync, so nothing validates them) --------------

GPU_KERNELS = [(b, d) for b, d in BACKENDS if b in ("cuda", "triton")]
MARGIN = 64  # poisoned elements before and after every array the kernel is given


def padded(shape, fill, dtype, device):
    """A tensor of `shape` inside a larger buffer poisoned with `fill` in MARGIN leading rows and
    MARGIN trailing rows: (the tensor, the buffer)."""
    buf = torch.full((shape[0] + 2 * MARGIN,) + tuple(shape[1:]), fill, dtype=dtype, device=device)
    return buf[MARGIN : MARGIN + shape[0]], buf


def run_in_margins(backend, device, logits, tokens, offsets, mask_id, threshold, credit, edit_threshold=None):
    """One kernel call on arrays that sit inside poisoned buffers; asserts the margins are untouched
    and returns the outputs, tokens and credit on the host. With edit_threshold: the joint rule, every
    row editable (from a buffer whose margins are editable too)."""
    N, V = logits.shape
    K = credit[0].shape[1]
    # Rows past the logits hold a logit that would win every max and show in the candidates.
    lg, lg_buf = padded((N, V), 1e4, logits.dtype, device)
    lg.copy_(logits)
    tok, tok_buf = padded((N,), 7777, torch.int64, device)
    tok.copy_(tokens)
    ids, ids_buf = padded((N, K), 5, torch.int32, device)
    ids.copy_(credit[0])
    vals, vals_buf = padded((N, K), 99.0, torch.float32, device)
    vals.copy_(credit[1])
    outs = [
        padded((N,), -7, torch.int64, device),
        padded((N,), float("nan"), torch.float32, device),
        padded((N,), True, torch.bool, device),
    ]
    nonfinite, nonfinite_buf = padded((N,), True, torch.bool, device)
    editable = None if edit_threshold is None else padded((N,), True, torch.bool, device)[0]
    params = decode_params(
        mask_id,
        rule="threshold" if edit_threshold is None else "joint",
        threshold=threshold.to(device),
        low_threshold=0.4,
        num_commit=torch.zeros_like(threshold, dtype=torch.int32).to(device),
        credit_alpha=0.7,
        credit_beta=0.8,
        credit_gamma=0.2,
        editable=editable,
        edit_threshold=edit_threshold,
    )
    backend_impl(backend)(lg, tok, offsets.to(device), ids, vals, *[o for o, _ in outs], nonfinite, params)
    before = lambda buf, fill: torch.full_like(buf[:MARGIN], fill)
    for name, buf, fill in [
        ("logits", lg_buf, 1e4),
        ("tokens", tok_buf, 7777),
        ("credit ids", ids_buf, 5),
        ("credit vals", vals_buf, 99.0),
        ("candidate", outs[0][1], -7),
        ("confidence", outs[1][1], float("nan")),
        ("commit", outs[2][1], True),
        ("nonfinite", nonfinite_buf, True),
    ]:
        for part in (buf[:MARGIN], buf[MARGIN + N :]):
            assert torch.equal(part.isnan(), before(part, fill).isnan()) and torch.equal(
                part.nan_to_num(), before(part, fill).nan_to_num()
            ), f"{name}: written out of bounds"
    return [o.cpu() for o, _ in outs], tok.cpu(), (ids.cpu(), vals.cpu())


def assert_same_step(got, want, truth):
    """Outputs of a kernel step against the fp32 reference step and its fp64 truth."""
    (cand, conf, commit), tok, cred = got
    (ref_cand, ref_conf, ref_commit), ref_tok, ref_cred = want
    assert torch.equal(cand, ref_cand) and torch.equal(commit, ref_commit) and torch.equal(tok, ref_tok)
    assert torch.equal(cred[0], ref_cred[0])
    assert_precision(conf, ref_conf, truth[0], "confidence")
    assert_precision(cred[1], ref_cred[1], truth[1], "credit values")


def reference_step(logits, tokens, offsets, mask_id, threshold, credit, edit_threshold=None):
    """The reference step in fp32 and its fp64 truth, on copies (the joint rule with edit_threshold)."""
    results = []
    for dtype in (torch.float32, torch.float64):
        tok, ids, vals = tokens.clone(), credit[0].clone(), credit[1].clone()
        out = decode_step_reference(
            logits,
            tok,
            offsets,
            decode_params(
                mask_id,
                rule="threshold" if edit_threshold is None else "joint",
                threshold=threshold,
                edit_threshold=edit_threshold,
            ),
            credit_ids=ids,
            credit_vals=vals,
            compute_dtype=dtype,
        )
        results.append(([out.candidate, out.confidence, out.commit], tok, (ids, vals)))
    truth = (results[1][0][1].double(), results[1][2][1].double())
    return results[0], truth


@pytest.mark.parametrize("backend,device", GPU_KERNELS)
@pytest.mark.parametrize("edit_threshold", [None, 0.05])
def test_unchecked_offsets_are_clamped(backend, device, edit_threshold):
    """Offsets outside [0, N] or decreasing (unvalidated, as on a GPU) act as their clamped values
    lo = clamp(o[b], 0, N), hi = clamp(o[b+1], lo, N), as in the CUDA kernel: nothing outside the
    arrays is read or written, whatever the values; also under the joint rule's edits."""
    N, V, K = 12, 37, 4
    logits, tokens, _, mask_id = make_case(N, V, [0, N])
    credit = (torch.full((N, K), -1, dtype=torch.int32), torch.zeros(N, K))
    for bad, clamped in (
        ([-7, 3, N + 50], [0, 3, N]),
        ([0, N + 5, 3, -1], [0, N, N, N]),
        ([-(2**31), 2, 2, 2**31 - 1], [0, 2, 2, N]),
    ):
        threshold = torch.rand(len(bad) - 1)
        got = run_in_margins(
            backend,
            device,
            logits,
            tokens,
            torch.tensor(bad, dtype=torch.int32),
            mask_id,
            threshold,
            credit,
            edit_threshold,
        )
        want, truth = reference_step(
            logits,
            tokens,
            torch.tensor(clamped, dtype=torch.int32),
            mask_id,
            threshold,
            credit,
            edit_threshold,
        )
        assert_same_step(got, want, truth)


@pytest.mark.parametrize("backend,device", GPU_KERNELS)
def test_unchecked_credit_ids_are_empty_slots(backend, device):
    """Credit slot ids outside [0, V) (unvalidated, as on a GPU) are empty slots, reset to (-1, 0)
    and never read, as in the CUDA kernel (decode_math.h); on the last row such an id would read past
    the logits."""
    N, V, K = 6, 41, 4
    logits, tokens, offsets, mask_id = make_case(N, V, [0, 2, N], masked_frac=1.0)
    ids = torch.tensor(
        [
            [V, 3, -1, 5],
            [-1, V + 7, 9, -5],
            [2, V, V + 1, V + 2],
            [-1, -1, -1, -1],
            [V + 40, 1, -1, 2],
            [V, V + 3, 0, V + 50],
        ],
        dtype=torch.int32,
    )
    vals = torch.rand(N, K) * 3
    threshold = torch.tensor([0.2, 0.9])
    got = run_in_margins(backend, device, logits, tokens, offsets, mask_id, threshold, (ids, vals))
    empty = (ids < 0) | (ids >= V)
    as_empty = (ids.masked_fill(empty, -1), vals.masked_fill(empty, 0.0))
    want, truth = reference_step(logits, tokens, offsets, mask_id, threshold, as_empty)
    assert_same_step(got, want, truth)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("mask_id", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sequences_without_any_fallback_commit_the_default_token(backend, device, rule, mask_id, dtype):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nonfinite_flags(backend, device, dtype):
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


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_row_keys_key_the_noise(backend, device):
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
