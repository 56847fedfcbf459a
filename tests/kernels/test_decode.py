"""Every decode_step backend against the reference (dinfer_kernels/reference/decode.py).

The checks (tests/helpers/decode_checks.py) call the backend implementations directly with poisoned,
caller-allocated outputs so an unwritten element fails; the public op is tested in test_decode_api.py.
"""

import pytest
import torch
from conftest import assert_precision, device_backends
from helpers.decode_checks import (
    RULES,
    backend_impl,
    check_backend,
    check_credit_over_a_block,
    check_dtypes_and_row_stride,
    check_inf_nan_and_dead_rows,
    check_joint_commits_and_edits,
    check_joint_edit_threshold_is_strict,
    check_joint_never_edits_the_prompt_tail,
    check_joint_only_masks_is_the_threshold_rule,
    check_many_sequences_and_empty_ones,
    check_no_mask_all_mask_and_mask_predictions,
    check_nonfinite_flags,
    check_row_keys_key_the_noise,
    check_sampling_matches_reference,
    check_sampling_reproducible_per_seed,
    check_sequences_without_any_fallback_commit_the_default_token,
    check_shapes_and_rules,
    check_ties_pick_lowest_index,
    make_case,
    ragged_offsets,
    small_vocab,
)

from dinfer_kernels.reference import decode_params, decode_step_reference

BACKENDS = device_backends()
pytestmark = pytest.mark.usefixtures("host_isa")  # the host kernels under every ISA this CPU runs


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
    check_shapes_and_rules(backend, device, rule, N, V)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_and_row_stride(backend, device, dtype):
    check_dtypes_and_row_stride(backend, device, dtype)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_ties_pick_lowest_index(backend, device):
    check_ties_pick_lowest_index(backend, device)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_inf_nan_and_dead_rows(backend, device):
    check_inf_nan_and_dead_rows(backend, device)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_no_mask_all_mask_and_mask_predictions(backend, device, rule):
    check_no_mask_all_mask_and_mask_predictions(backend, device, rule)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("slots", [4, 16])
@pytest.mark.parametrize("rule", ["threshold", "joint"])
def test_credit_over_a_block(backend, device, slots, rule):
    check_credit_over_a_block(backend, device, slots, rule)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("rule", list(RULES))
def test_sampling_matches_reference(backend, device, rule):
    check_sampling_matches_reference(backend, device, rule)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_sampling_reproducible_per_seed(backend, device):
    check_sampling_reproducible_per_seed(backend, device)


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
    check_many_sequences_and_empty_ones(backend, device)


# ---- the joint rule (LLaDA2.1's JointThreshold): the threshold rule plus token-to-token edits -----


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
    check_joint_commits_and_edits(backend, device, V, dtype, temperature)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_joint_edit_threshold_is_strict(backend, device):
    check_joint_edit_threshold_is_strict(backend, device)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_joint_only_masks_is_the_threshold_rule(backend, device):
    check_joint_only_masks_is_the_threshold_rule(backend, device)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_joint_never_edits_the_prompt_tail(backend, device):
    check_joint_never_edits_the_prompt_tail(backend, device)


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
    check_sequences_without_any_fallback_commit_the_default_token(backend, device, rule, mask_id, dtype)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nonfinite_flags(backend, device, dtype):
    check_nonfinite_flags(backend, device, dtype)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_row_keys_key_the_noise(backend, device):
    check_row_keys_key_the_noise(backend, device)
