"""The Triton soft_embedding against the reference (dinfer_kernels/reference/soft_embedding.py).

The backend function is called directly with a NaN-poisoned, caller-allocated output, so an unwritten
element fails. Without a GPU it runs in the Triton interpreter (conftest sets TRITON_INTERPRET), so
shapes stay small; bf16 is only tested on a GPU (the interpreter's bf16 arithmetic is unreliable).
Tolerance: the error against a float64 reference is at most twice that of the fp32 torch reference
on the same inputs, plus a small floor: over the whole output (conftest.assert_precision) and per
element, with one ulp of the output dtype as the floor (so small outputs, e.g. from cancellation in
P @ E, are checked too: rounding P to 16 bits before the GEMM fails this).
"""

import itertools
import math

import pytest
import torch
from conftest import HAS_GPU, HAS_TRITON, assert_precision

import dinfer_kernels as dk
from dinfer_kernels import op_inputs
from dinfer_kernels.reference import soft_embedding_reference

# With a GPU every case here runs the Triton kernel on it.
pytestmark = [pytest.mark.skipif(not HAS_TRITON, reason="needs triton")] + (
    [pytest.mark.gpu] if HAS_GPU else []
)

DEVICE = "cuda" if HAS_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])
# Both routes of the Triton backend (the shape rule, triton/soft_embedding.route, picks one by rows);
# the GEMM route takes 16-bit embeddings only.
ROUTES = [(dt, "one_pass") for dt in DTYPES] + [(dt, "gemm") for dt in DTYPES if dt != torch.float32]


def run_triton(logits, embedding, tokens, mask_id, weight, tau, route=None):
    from dinfer_kernels.triton.soft_embedding import soft_embedding

    out = torch.full(
        (logits.shape[0], embedding.shape[1]), float("nan"), dtype=embedding.dtype, device=DEVICE
    )
    w = torch.as_tensor(weight, dtype=torch.float32).reshape(-1).expand(logits.shape[0]).contiguous()
    soft_embedding(
        logits.to(DEVICE),
        embedding.to(DEVICE),
        tokens.to(DEVICE),
        w.to(DEVICE),
        out,
        mask_id=mask_id,
        tau=tau,
        force_route=route,
    )
    return out.cpu()


def assert_elementwise(out, same, truth):
    """|out - truth| <= 2 |same - truth| + one ulp of the output dtype (and 1e-6 for fp32), per element."""
    info = torch.finfo(out.dtype)
    floor = info.eps * truth.abs() + (1e-6 if out.dtype == torch.float32 else info.tiny)
    excess = (out.double() - truth).abs() - (2 * (same.double() - truth).abs() + floor)
    assert excess.max() <= 0, f"element error above tolerance by {float(excess.max()):.3g}"


def check(logits, embedding, tokens, mask_id, weight=0.3, tau=1.0, route=None):
    """Triton vs the fp32 reference (same inputs) and the float64 truth; returns the Triton output.
    route: force the one-pass kernel or the GEMM route (default: the shape rule's choice)."""
    out = run_triton(logits, embedding, tokens, mask_id, weight, tau, route)
    same = soft_embedding_reference(logits, embedding, tokens, mask_id, weight, tau)
    truth = soft_embedding_reference(
        logits, embedding.double(), tokens, mask_id, weight, tau, compute_dtype=torch.float64
    )
    assert out.dtype == embedding.dtype and not out.isnan().any()
    assert_precision(out, same, truth, "soft_embedding")
    assert_elementwise(out, same, truth)
    return out


def make_case(M, V, d, dtype, masked_frac=0.5, logit_dtype=None):
    a = op_inputs.soft_embedding_inputs(
        M, V, d, dtype=dtype, logits_dtype=logit_dtype, masked_frac=masked_frac
    )
    return a["logits"], a["embedding"], a["tokens"], a["mask_id"]


def test_reference_matches_hand_formula():
    logits = torch.tensor([[1.0, 2.0, float("nan")], [0.5, -1.0, 3.0]])
    E = torch.tensor([[1.0, -2.0], [0.5, 4.0], [3.0, 0.25]])
    tokens = torch.tensor([2, 0])  # mask_id 2: row 0 masked, row 1 not
    w, tau = 0.25, 2.0
    e1, e2 = math.exp(1.0 / tau), math.exp(2.0 / tau)  # NaN counts as -inf: weight 0
    p = [e1 / (e1 + e2), e2 / (e1 + e2), 0.0]
    soft = [sum(p[v] * float(E[v, j]) for v in range(3)) for j in range(2)]
    expected = torch.tensor([[float(E[2, j]) + w * soft[j] for j in range(2)], E[0].tolist()])
    out = soft_embedding_reference(logits, E, tokens, 2, w, tau)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,route", ROUTES)
@pytest.mark.parametrize("M,V,d", list(itertools.product([1, 3, 17], [1, 7, 1000], [8, 24, 72])))
def test_shapes(M, V, d, dtype, route):
    check(*make_case(M, V, d, dtype), weight=0.7, tau=0.8, route=route)


@pytest.mark.parametrize("dtype,route", ROUTES)
def test_vocab_splits(dtype, route):
    """V large enough for several stats chunks and several GEMM vocabulary splits (+ reduce)."""
    check(*make_case(5, 5000, 40, dtype, masked_frac=0.6), weight=1.0, tau=1.5, route=route)


@pytest.mark.parametrize("dtype,route", ROUTES)
def test_no_masked_and_all_masked(dtype, route):
    logits, E, tokens, mask_id = make_case(6, 300, 24, dtype)
    none = torch.where(tokens == mask_id, (tokens + 1) % 300, tokens)
    out = check(logits, E, none, mask_id, route=route)
    assert torch.equal(out, E[none])  # no soft part at all: exact copies
    check(logits, E, torch.full_like(tokens, mask_id), mask_id, route=route)


@pytest.mark.parametrize("dtype,route", ROUTES)
def test_dead_rows_nan_inf(dtype, route):
    logits, E, tokens, mask_id = make_case(7, 300, 24, dtype, masked_frac=1.0, logit_dtype=torch.float32)
    logits[0, :] = float("-inf")  # dead: adds nothing
    logits[1, :] = float("nan")  # all NaN: dead too
    logits[2, ::3] = float("nan")
    logits[3, 10] = float("inf")  # +inf -> FLT_MAX: all weight on token 10
    logits[4, 5] = float("-inf")
    logits[5, 11] = logits[5, 12] = float("inf")  # two at FLT_MAX share the weight
    out = check(logits.to(dtype), E, tokens, mask_id, route=route)
    assert torch.equal(out[:2], E[tokens[:2]])


@pytest.mark.parametrize("dtype,route", ROUTES)
@pytest.mark.parametrize("peak", [0.0, 3.0, 8.0])
def test_soft_part_dominates(dtype, route, peak):
    """E[mask] = 0 and weight 1: the output is the GEMM alone, flat to peaked softmaxes."""
    logits, E, tokens, mask_id = make_case(16, 2000, 64, dtype, masked_frac=1.0)
    E[mask_id] = 0
    check(logits.float().mul(peak / 3).to(dtype), E, tokens, mask_id, weight=1.0, route=route)


@pytest.mark.parametrize("dtype,route", ROUTES)
def test_small_probabilities(dtype, route):
    """Thousands of equal probabilities ~1e-6 (fp16 subnormals) on equal embedding rows: their
    rounding errors add up coherently unless P keeps full precision."""
    V = 2000
    logits = torch.full((3, V), -13.8)
    logits[:, 0] = 0.0
    E = torch.ones(V, 8, dtype=dtype)
    E[0] = E[1] = 0  # token 0 dominates; mask_id 1
    check(logits.to(dtype), E, torch.ones(3, dtype=torch.int64), 1, weight=1.0, route=route)


@pytest.mark.parametrize("dtype,route", ROUTES)
def test_a_weight_per_row(dtype, route):
    """[M] weights (each sequence's w_n, repeated over its block): each row as with its own scalar."""
    logits, E, tokens, mask_id = make_case(12, 300, 24, dtype, masked_frac=0.7)
    w = torch.linspace(0.0, 1.0, 12)
    check(logits, E, tokens, mask_id, weight=w, route=route)
    per_row = soft_embedding_reference(logits, E, tokens, mask_id, w)
    for i in (0, 5, 11):
        scalar = soft_embedding_reference(logits, E, tokens, mask_id, float(w[i]))
        assert torch.equal(per_row[i], scalar[i])
    assert torch.equal(dk.soft_embedding(logits, E, tokens, mask_id, w, backend="torch"), per_row)
    with pytest.raises(ValueError, match="^weight"):
        dk.soft_embedding(logits, E, tokens, mask_id, torch.ones(13), backend="torch")


def test_strided_logits_and_mixed_dtypes():
    big = torch.randn(9, 400) * 2
    logits = big[:, :333]  # row stride 400 > V
    E = torch.randn(333, 24, dtype=torch.float16)
    tokens = torch.full((9,), 7)
    tokens[::4] = 0
    check(logits, E, tokens, 7, weight=0.15, tau=0.5)


@pytest.mark.parametrize("dtype,route", [(torch.float32, "one_pass"), (torch.float16, "gemm")])
def test_unchecked_tokens_outside_the_vocabulary_give_zero_rows(dtype, route):
    """A token outside [0, V) is an error where values are checked (host tensors, by default) and,
    unchecked (as on a GPU), a row of zeros on every backend: never a read outside the embedding,
    which sits here inside a poisoned buffer that any such read would show."""
    M, V, d, margin = 9, 50, 24, 64
    logits, embedding, tokens, mask_id = make_case(M, V, d, dtype)
    buf = torch.full((V + 2 * margin, d), 1e4, dtype=dtype)
    E = buf[margin : margin + V]
    E.copy_(embedding)
    bad_rows = torch.tensor([0, 4, 7, 8])
    good = torch.ones(M, dtype=torch.bool)
    good[bad_rows] = False
    with pytest.raises(ValueError, match="tokens"):
        dk.soft_embedding(logits, E, tokens.index_fill(0, bad_rows, V), mask_id, 0.3, backend="torch")
    # ids just outside the table (inside the poisoned margins) first, then far outside
    for ids in ([-1, V, -margin, V + margin - 1], [-(2**40), 2**40, -(2**63), 2**63 - 1]):
        bad_tokens = tokens.clone()
        bad_tokens[bad_rows] = torch.tensor(ids)
        same = soft_embedding_reference(logits, E, tokens, mask_id, 0.3)
        truth = soft_embedding_reference(
            logits, E.double(), tokens, mask_id, 0.3, compute_dtype=torch.float64
        )
        ref = dk.soft_embedding(logits, E, bad_tokens, mask_id, 0.3, backend="torch", validate=False)
        for out in (run_triton(logits, E, bad_tokens, mask_id, 0.3, 1.0, route), ref):
            assert torch.equal(out[bad_rows], torch.zeros(len(bad_rows), d, dtype=dtype))
            assert_precision(out[good], same[good], truth[good], "soft_embedding")


def test_shape_rule():
    """The one pass up to ONE_PASS_MAX_ROWS rows of a 16-bit E, the GEMM route past it; fp32 E always
    one pass. Each side of the boundary against the reference with the rule's own choice."""
    from dinfer_kernels.triton import soft_embedding as tse

    limit = tse.ONE_PASS_MAX_ROWS
    assert [tse.route(M, torch.float16) for M in (1, limit, limit + 1)] == ["one_pass", "one_pass", "gemm"]
    assert tse.route(10 * limit, torch.bfloat16) == "gemm"
    assert tse.route(10 * limit, torch.float32) == "one_pass"
    for M in (limit, limit + 1):
        check(*make_case(M, 200, 24, torch.float16, masked_frac=0.8))


@pytest.mark.parametrize("dtype,route", ROUTES)
@pytest.mark.parametrize("M,V,d", [(1, 4099, 257), (13, 1031, 300), (97, 211, 300)])
def test_awkward_shapes(M, V, d, dtype, route):
    """Primes, d past one d tile and not a multiple of it, M past one M tile (97 > 64) with several d tiles."""
    check(*make_case(M, V, d, dtype, masked_frac=0.7), weight=0.6, tau=1.3, route=route)


@pytest.mark.parametrize("dtype,route", ROUTES)
def test_full_vocabulary_small_dim(dtype, route):
    """LLaDA-MoE's V = 157184 at a small d: many vocabulary splits, each a long loop."""
    check(*make_case(3, 157184, 16, dtype, masked_frac=1.0), weight=0.4, route=route)


@pytest.mark.parametrize("dtype,route", ROUTES)
def test_bit_identical_runs(dtype, route):
    """Several vocabulary splits reduced in a fixed order: two runs give the same bits."""
    logits, E, tokens, mask_id = make_case(5, 5000, 300, dtype, masked_frac=0.8)
    first = run_triton(logits, E, tokens, mask_id, 0.5, 1.0, route)
    assert torch.equal(first, run_triton(logits, E, tokens, mask_id, 0.5, 1.0, route))


def test_bad_route():
    logits, E, tokens, mask_id = make_case(3, 100, 8, torch.float32)
    for bad in ("gemm", "fast"):  # no GEMM route for an fp32 E (cuBLAS could round through TF32)
        with pytest.raises(ValueError, match="^force_route"):
            run_triton(logits, E, tokens, mask_id, 0.3, 1.0, bad)


@pytest.mark.gpu  # bf16 at the full vocabulary: a GPU only
@pytest.mark.parametrize("M,d", [(64, 512), (128, 256)])
def test_full_vocabulary_bf16_on_the_gpu(M, d):
    """bf16 at V 157184 on each side of the shape rule (the references run on the host: d kept small)."""
    check(*make_case(M, 157184, d, torch.bfloat16, masked_frac=0.9), weight=0.3)
