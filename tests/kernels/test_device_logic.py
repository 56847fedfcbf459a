"""The CUDA kernels' host-callable logic executed thread by thread on the host, against the reference.

tests/kernels/device_logic/*.cpp drive the kernels' own `__host__ __device__` functions (decode_split.h,
decode_math.h, ...) with the kernels' grids, thread striding, reduction trees and barrier order;
they are compiled here with g++ into one library loaded through ctypes, so CI without a GPU runs
the code the GPU runs (hardware exp2 / log2 approximations aside: scalar.h). The decode emulation
is a backend of the decode checks (tests/helpers/decode_checks.py: poisoned outputs, fp64 truth,
precision-tied tolerances) and runs their edge cases, as tests/kernels/test_decode.py does for the
built backends.
"""

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import EXT, HAS_GPU, ROOT, assert_precision
from helpers import decode_checks

from dinfer_kernels.reference import decode_params, decode_step_reference
from dinfer_kernels.reference.attention import paged_rows

SOURCES = sorted((Path(__file__).resolve().parent / "device_logic").glob("*.cpp"))
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
EMULATED = "cuda-on-host"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def build(so, *flags):
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-Wall",
            "-Wextra",
            "-Werror",
            *flags,
            f"-I{ROOT / 'csrc/include'}",
            *map(str, SOURCES),
            "-o",
            str(so),
        ],
        check=True,
    )


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    so = tmp_path_factory.mktemp("device_logic") / "device_logic.so"
    build(so)
    return ctypes.CDLL(str(so))


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr() if t is not None and t.numel() else 0)


def emulated_decode_step(lib, grid=0, order=0):
    """The internal decode_step signature of dinfer_kernels/{cpu,cuda}/decode.py, on host tensors:
    the split pass as a persistent grid of `grid` CTAs (0: an H200's 660 slots) whose units run
    interleaved in the seeded `order` (0: increasing)."""
    f = lib.dinfer_decode_step_cuda_on_host
    i64, i32, u32, flt, vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p
    f.argtypes = [
        vp,
        i32,
        i64,
        i64,
        i64,
        vp,
        vp,
        i64,
        i64,
        i32,
        vp,
        vp,
        flt,
        flt,
        u32,
        u32,
        vp,
        vp,
        i32,
        flt,
        flt,
        flt,
        vp,
        vp,
        vp,
        vp,
        vp,
        vp,
        flt,
        u32,
        u32,
    ]
    f.restype = ctypes.c_int

    def decode_step(
        logits, tokens, seq_offsets, credit_ids, credit_vals, candidate, confidence, commit, nonfinite, params
    ):
        rule, sampling, credit, edit = params.rule, params.sampling, params.credit, params.edit
        assert logits.stride(1) == 1 or logits.shape[1] <= 1
        N, V = logits.shape
        rc = f(
            _ptr(logits),
            DTYPES[logits.dtype],
            N,
            V,
            logits.stride(0) if N > 1 else V,
            _ptr(tokens),
            _ptr(seq_offsets),
            seq_offsets.numel() - 1,
            params.mask_id,
            rule.code,
            _ptr(rule.threshold),
            _ptr(rule.num_commit),
            rule.low_threshold,
            sampling.temperature,
            sampling.seed,
            sampling.offset,
            _ptr(credit_ids),
            _ptr(credit_vals),
            credit_ids.shape[1],
            credit.alpha,
            credit.beta,
            credit.gamma,
            _ptr(candidate),
            _ptr(confidence),
            _ptr(commit),
            _ptr(nonfinite),
            _ptr(sampling.row_keys),
            _ptr(edit.editable),
            edit.kernel_threshold,
            grid,
            order,
        )
        assert rc == 0

    return decode_step


@pytest.fixture
def emulated(lib, monkeypatch):
    """The decode checks, with the emulated CUDA kernels as backend EMULATED: patched where
    run_backend looks backend_impl up."""
    impl = emulated_decode_step(lib)
    real = decode_checks.backend_impl
    monkeypatch.setattr(decode_checks, "backend_impl", lambda b: impl if b == EMULATED else real(b))
    return impl


# ---- decode step -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", list(decode_checks.RULES))
@pytest.mark.parametrize("N,V", [(1, 1), (3, 7), (2, 255), (64, 1000), (3, 32003), (5, 157184)])
def test_decode_shapes_and_rules(emulated, rule, N, V):
    """Rows shorter than one thread's vector, than a CTA's 256 threads, and the real vocabulary
    (splits whose chunks end inside a vector of the next)."""
    decode_checks.check_shapes_and_rules(EMULATED, "cpu", rule, N, V)


@pytest.mark.parametrize("rule", list(decode_checks.RULES))
def test_decode_sequence_longer_than_the_shared_stage(emulated, rule):
    """A sequence of more rows than the finalize kernel stages in shared memory (1024) reads the
    global copies in phases b and c."""
    N, V = 1030, 40
    logits, tokens, offsets, mask_id = decode_checks.make_case(N, V, [0, 3, N], scale=1.0)
    decode_checks.check_backend(
        EMULATED,
        "cpu",
        logits,
        tokens,
        offsets,
        mask_id,
        rule,
        num_commit=torch.tensor([1, 700], dtype=torch.int32),
    )


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_dtypes_and_misaligned_rows(emulated, dtype):
    decode_checks.check_dtypes_and_row_stride(EMULATED, "cpu", dtype)


@pytest.mark.parametrize(
    "case",
    [
        "check_ties_pick_lowest_index",
        "check_inf_nan_and_dead_rows",
        "check_many_sequences_and_empty_ones",
        "check_sampling_reproducible_per_seed",
        "check_row_keys_key_the_noise",
    ],
)
def test_decode_edge_cases(emulated, case):
    getattr(decode_checks, case)(EMULATED, "cpu")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_nonfinite_flags(emulated, dtype):
    """The split pass's per-thread flag, merged through the kernels' reduction trees."""
    decode_checks.check_nonfinite_flags(EMULATED, "cpu", dtype)


@pytest.mark.parametrize("rule", list(decode_checks.RULES))
@pytest.mark.parametrize("mask_id", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_default_token(emulated, rule, mask_id, dtype):
    decode_checks.check_sequences_without_any_fallback_commit_the_default_token(
        EMULATED, "cpu", rule, mask_id, dtype
    )


@pytest.mark.parametrize("rule", list(decode_checks.RULES))
def test_decode_mask_predictions_and_sampling(emulated, rule):
    decode_checks.check_no_mask_all_mask_and_mask_predictions(EMULATED, "cpu", rule)
    decode_checks.check_sampling_matches_reference(EMULATED, "cpu", rule)


@pytest.mark.parametrize("slots", [4, 16])
@pytest.mark.parametrize("rule", ["threshold", "joint"])
def test_decode_credit(emulated, slots, rule):
    decode_checks.check_credit_over_a_block(EMULATED, "cpu", slots, rule)


@pytest.mark.parametrize("V", [41, 157184])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_decode_joint_commits_and_edits(emulated, V, dtype, temperature):
    """The joint rule's edits in phase c of the finalize kernel (decode_math.h row_edits), next to
    its threshold commits: every kind of row, editing off, sampled candidates."""
    decode_checks.check_joint_commits_and_edits(EMULATED, "cpu", V, dtype, temperature)


@pytest.mark.parametrize(
    "case",
    [
        "check_joint_edit_threshold_is_strict",
        "check_joint_only_masks_is_the_threshold_rule",
        "check_joint_never_edits_the_prompt_tail",
    ],
)
def test_decode_joint_edge_cases(emulated, case):
    getattr(decode_checks, case)(EMULATED, "cpu")


def test_decode_all_equal_rows_across_splits(emulated):
    """Every split holds the maximum: the merges of the reduction tree and of the splits must keep
    the lowest index, in every dtype. With the mask token at index 0 the candidates are the mask
    token, and each sequence's progress-guarantee row (its first) takes token 1."""
    N, V = 4, 157184
    offsets = torch.tensor([0, 1, 4], dtype=torch.int32)
    for dtype in DTYPES:
        for mask_id, expected in ((V - 1, [0, 0, 0, 0]), (0, [1, 1, 0, 0])):
            logits = torch.zeros(N, V, dtype=dtype)
            tokens = torch.full((N,), mask_id, dtype=torch.int64)
            outs = decode_checks.check_backend(EMULATED, "cpu", logits, tokens, offsets, mask_id, "threshold")
            assert outs[0].tolist() == expected


# (grid, order): one CTA walking every unit; a grid smaller than a row's splits; an interleaving
# of CTAs whose rows' last units land on varying CTAs; a grid larger than the unit count.
GRIDS_AND_ORDERS = [(1, 0), (3, 7), (7, 11), (19, 12345), (5000, 99)]


@pytest.mark.parametrize("rule", list(decode_checks.RULES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_any_grid_and_cta_order_gives_the_same_bits(lib, monkeypatch, rule, dtype):
    """The persistent grid's results do not depend on how many CTAs walk the units nor on which CTA
    completes a row (its merge runs in split order): every grid and interleaving gives the bits of
    the in-order walk, and passes the reference checks. V = 157184 with ties across the chunks of
    different splits (the maximum repeated in every split), NaN / +-inf rows and credit slots."""
    N, V = 12, 157184
    logits, tokens, offsets, mask_id = decode_checks.make_case(N, V, [0, 5, 5, 12], dtype)
    logits[1, :] = 0.0  # every split ties at the maximum: the lowest index must win the merges
    logits[2, 7] = logits[2, V - 5] = logits[2].max().item() + 1.0  # a tie between the first and last splits
    logits[3, 100] = float("nan")
    logits[4, V // 2 + 1] = float("inf")
    logits[6, :] = float("-inf")
    credit = (torch.randint(-1, V, (N, 3), dtype=torch.int32), torch.rand(N, 3))
    temperature = 0.7 if rule == "hierarchical" else 0.0
    real = decode_checks.backend_impl
    results = []
    for grid, order in [(0, 0), *GRIDS_AND_ORDERS]:
        impl = emulated_decode_step(lib, grid, order)
        monkeypatch.setattr(
            decode_checks, "backend_impl", lambda b, impl=impl: impl if b == EMULATED else real(b)
        )
        kw = dict(temperature=temperature, seed=5)
        if (grid, order) == (0, 0):
            decode_checks.check_backend(
                EMULATED, "cpu", logits, tokens, offsets, mask_id, rule, credit=credit, **kw
            )
        thr, k = torch.full((3,), 0.3), torch.tensor([2, 0, 3], dtype=torch.int32)
        results.append(
            decode_checks.run_backend(
                EMULATED, "cpu", logits, tokens, offsets, mask_id, rule, thr, k, credit, **kw
            )
        )
    bits = lambda t: t.view(torch.int32) if t.dtype == torch.float32 else t  # NaN-safe, -0.0 != 0.0
    (outs0, tok0, cred0), *rest = results
    for outs, tok, cred in rest:
        for a, b in zip([*outs, tok, *cred], [*outs0, tok0, *cred0], strict=True):
            assert torch.equal(bits(a), bits(b))


def test_decode_bad_credit_ids_are_empty_slots(emulated):
    """Slot ids outside [0, V) are treated as empty slots, never read: the result equals the
    reference's with those slots emptied."""
    N, V, K = 6, 4099, 4
    logits, tokens, offsets, mask_id = decode_checks.make_case(N, V, [0, 3, 6], masked_frac=1.0)
    ids = torch.randint(0, V, (N, K), dtype=torch.int32)
    ids[:, 1] = V
    ids[0, 2] = -5
    ids[N - 1, 3] = 2**31 - 1  # last row: past the buffer if it were read
    vals = torch.rand(N, K)
    bad = (ids < 0) | (ids >= V)
    thr, k = torch.full((2,), 0.5), torch.zeros(2, dtype=torch.int32)
    outs, tok, (ids_e, vals_e) = decode_checks.run_backend(
        EMULATED, "cpu", logits, tokens, offsets, mask_id, "threshold", thr, k, (ids, vals)
    )
    ref_ids, ref_vals = ids.masked_fill(bad, -1), vals.masked_fill(bad, 0.0)
    ref = decode_step_reference(
        logits,
        tokens.clone(),
        offsets,
        decode_params(mask_id, threshold=thr),
        credit_ids=ref_ids,
        credit_vals=ref_vals,
    )
    assert torch.equal(outs[0], ref.candidate) and torch.equal(ids_e, ref_ids)
    assert torch.equal(outs[2], ref.commit)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAS_GPU and EXT is not None and EXT.built_with_cuda()), reason="needs the CUDA kernels"
)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("rule", ["hierarchical", "joint"])
def test_decode_host_run_matches_the_gpu(emulated, dtype, temperature, rule):
    """The GPU and its host run take the same decisions: candidates, commits, non-finite flags, tokens
    and credit slots agree exactly; confidences, where MUFU.EX2 stands against exp2f, are as close to
    the fp64 truth as the host run's. The joint rule edits the rows its steps commit."""
    N, V, B = 64, 157184, 5
    logits, tokens, offsets, mask_id = decode_checks.make_case(
        N, V, decode_checks.ragged_offsets(N, B), dtype
    )
    edits = dict(editable=torch.rand(N) < 0.7, edit_threshold=0.02) if rule == "joint" else {}
    thr, k = torch.rand(B), torch.randint(0, 4, (B,), dtype=torch.int32)
    credit = (torch.full((N, 4), -1, dtype=torch.int32), torch.zeros(N, 4))
    for _ in range(3):
        kw = dict(temperature=temperature, seed=3, **edits)
        args = (logits, tokens, offsets, mask_id, rule, thr, k, credit)
        gpu, tok_g, cred_g = decode_checks.run_backend("cuda", "cuda", *args, **kw)
        host, tok_h, cred_h = decode_checks.run_backend(EMULATED, "cpu", *args, **kw)
        ids, vals = credit[0].clone(), credit[1].clone()
        truth = decode_step_reference(
            logits,
            tokens.clone(),
            offsets,
            decode_params(mask_id, rule=rule, threshold=thr, num_commit=k, **kw),
            credit_ids=ids,
            credit_vals=vals,
            compute_dtype=torch.float64,
        )
        for i in (0, 2, 3):
            assert torch.equal(gpu[i], host[i])
        assert torch.equal(tok_g, tok_h) and torch.equal(cred_g[0], cred_h[0])
        assert_precision(gpu[1], host[1], truth.confidence.double(), "confidence")
        assert_precision(cred_g[1], cred_h[1], vals.double(), "credit values")
        tokens, credit = tok_h, cred_h


# ---- MoE routing and alignment -----------------------------------------------------------------------


def emulated_route(
    lib,
    logits,
    top_k,
    *,
    scoring="softmax",
    renormalize=False,
    bias=None,
    num_groups=1,
    topk_groups=1,
    scaling=1.0,
    e0=0,
    e1=None,
    shared_experts=0,
    bm=16,
    order_seed=0,
):
    """route_kernel on given logits: (topk_ids, topk_w [T, k] by increasing expert, sorted_ids,
    tile_expert, num_tiles) as the GEMMs read them."""
    f = lib.dinfer_moe_route_cuda_on_host
    i32, flt, vp = ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
    f.argtypes = [vp, i32, i32, i32, i32, i32, vp, i32, i32, flt, i32, i32, i32, i32, vp, vp, vp, vp, vp, vp]
    T, E = logits.shape
    e1 = E if e1 is None else e1
    tt = 16 if T > 256 else 4
    order = torch.randperm((T + tt - 1) // tt, generator=torch.Generator().manual_seed(order_seed))
    order = order.to(torch.int32)
    entries = T * (top_k + shared_experts)
    max_tiles = (entries + min(E + shared_experts, entries) * (bm - 1)) // bm
    ids = torch.full((T, top_k), -7, dtype=torch.int32)
    w = torch.full((T, top_k), float("nan"))
    sorted_ids = torch.full((max_tiles * bm,), -7, dtype=torch.int32)
    tile_expert = torch.full((max_tiles,), -7, dtype=torch.int32)
    num_tiles = torch.full((1,), -7, dtype=torch.int32)
    rc = f(
        _ptr(logits),
        T,
        E,
        top_k,
        {"softmax": 0, "sigmoid": 1}[scoring],
        int(renormalize),
        _ptr(bias),
        num_groups,
        topk_groups,
        scaling,
        e0,
        e1,
        shared_experts,
        bm,
        _ptr(order),
        _ptr(ids),
        _ptr(w),
        _ptr(sorted_ids),
        _ptr(tile_expert),
        _ptr(num_tiles),
    )
    assert rc == 0, "the emulated CTA deadlocked" if rc == 2 else f"rc {rc}"
    return ids, w, sorted_ids, tile_expert, int(num_tiles)


def route_truth(logits, bias, scoring, renormalize, scaling, experts):
    """The weights of the given experts in fp64 (the reference's formula)."""
    lg = logits.double()
    score = torch.softmax(lg, -1) if scoring == "softmax" else torch.sigmoid(lg)
    src = score + bias.double() if (bias is not None and scoring == "softmax") else score
    w = src.gather(1, experts)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling


def check_alignment(ids, sorted_ids, tile_expert, num_tiles, e0, e1, bm, shared_experts=0):
    """Each local expert's entries (token * k + slot) in increasing order, then each virtual expert's
    of the shared expert (T k + j T + t, every token), padded with -1 to whole tiles of bm rows, tiles
    in expert order; nothing else written."""
    flat = ids.flatten().long()
    T, k = ids.shape
    tiles, rows = [], []
    for e in range(e0, e1 + shared_experts):
        if e < e1:
            entries = torch.nonzero(flat == e).flatten().tolist()
        else:
            entries = [T * k + (e - e1) * T + t for t in range(T)]
        n = -(-len(entries) // bm)
        tiles += [e - e0] * n  # the local expert: w13 / w2 hold the local experts only
        rows += entries + [-1] * (n * bm - len(entries))
    assert num_tiles == len(tiles)
    assert tile_expert[:num_tiles].tolist() == tiles and (tile_expert[num_tiles:] == -7).all()
    assert sorted_ids[: num_tiles * bm].tolist() == rows and (sorted_ids[num_tiles * bm :] == -7).all()


ROUTE_CASES = {
    # name: (T, E, top_k, kwargs)
    "llada_moe": (37, 64, 8, dict(scoring="softmax")),
    "llada_moe_renorm_bias": (5, 64, 8, dict(scoring="softmax", renormalize=True, bias=True)),
    "llada2_groups": (
        41,
        256,
        8,
        dict(scoring="sigmoid", renormalize=True, bias=True, num_groups=8, topk_groups=4, scaling=2.5),
    ),
    "single_expert_groups": (9, 16, 3, dict(scoring="sigmoid", num_groups=16, topk_groups=5)),
    "max_experts_top32": (3, 512, 32, dict(scoring="softmax")),
    "one_token_prime_experts": (1, 7, 7, dict(scoring="softmax")),
    "prefill_tiles_of_16": (300, 8, 2, dict(scoring="softmax", bm=128)),
    "expert_range": (50, 64, 8, dict(scoring="sigmoid", e0=13, e1=40)),
    "empty_expert_range": (6, 8, 2, dict(scoring="softmax", e0=3, e1=3)),
    # the shared expert's virtual experts after the local ones (LLaDA2: one; S > I: three)
    "llada2_shared_expert": (
        41,
        256,
        8,
        dict(scoring="sigmoid", renormalize=True, bias=True, num_groups=8, topk_groups=4, shared_experts=1),
    ),
    "shared_experts_with_range": (50, 64, 8, dict(scoring="softmax", e0=13, e1=40, shared_experts=3)),
    "shared_experts_prefill": (300, 8, 2, dict(scoring="softmax", bm=128, shared_experts=2)),
    "shared_experts_only": (6, 8, 2, dict(scoring="softmax", e0=3, e1=3, shared_experts=1)),
    "shared_experts_fill_the_list": (3, 508, 4, dict(scoring="softmax", shared_experts=4)),
}


@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_moe_route_matches_reference(lib, case):
    from dinfer_kernels.reference.moe import route

    T, E, k, kw = ROUTE_CASES[case]
    kw = dict(kw)
    bias = torch.randn(E) * 0.1 if kw.pop("bias", False) else None
    bm, e0, e1 = kw.pop("bm", 16), kw.pop("e0", 0), kw.pop("e1", E)
    nv = kw.pop("shared_experts", 0)
    logits = torch.randn(T, E) * 2
    for seed in range(2):  # two CTA orders: a different CTA aligns
        ids, w, sorted_ids, tile_expert, num_tiles = emulated_route(
            lib, logits, k, bias=bias, e0=e0, e1=e1, shared_experts=nv, bm=bm, order_seed=seed, **kw
        )
        ref_w, ref_order = route(
            None,
            None,
            k,
            kw.get("renormalize", False),
            bias,
            router_logits=logits,
            scoring=kw["scoring"],
            num_groups=kw.get("num_groups", 1),
            topk_groups=kw.get("topk_groups", 1),
            routed_scaling=kw.get("scaling", 1.0),
        )
        by_expert = ref_order.sort(-1)
        assert torch.equal(ids.long(), by_expert.values)
        ref_w = ref_w.gather(1, by_expert.indices)
        truth = route_truth(
            logits,
            bias,
            kw["scoring"],
            kw.get("renormalize", False),
            kw.get("scaling", 1.0),
            by_expert.values,
        )
        assert_precision(w, ref_w, truth, "routing weights")
        check_alignment(ids, sorted_ids, tile_expert, num_tiles, e0, e1, bm, nv)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_moe_route_ties_nan_and_inf(lib, scoring):
    """All-equal logits pick the lowest experts (and groups); NaN ranks like -inf; +-inf logits."""
    from dinfer_kernels.reference.moe import route

    T, E, k = 6, 32, 4
    logits = torch.zeros(T, E)
    logits[1, 5] = float("nan")
    logits[2, :] = float("nan")  # every expert unrankable: still k distinct ones, lowest first
    logits[3, 7] = float("inf")
    logits[4, :8] = float("-inf")
    logits[5, 20:] = 1.0  # a tie among the higher experts
    for groups in (1, 8):
        ids, *_ = emulated_route(lib, logits, k, scoring=scoring, num_groups=groups, topk_groups=2)
        ref = (
            route(None, None, k, router_logits=logits, scoring=scoring, num_groups=groups, topk_groups=2)[1]
            .sort(-1)
            .values
        )
        assert torch.equal(ids.long(), ref)
        assert ids[0].tolist() == [0, 1, 2, 3] and ids[2].tolist() == [0, 1, 2, 3]
    assert ids[5].tolist() == [20, 21, 22, 23] and ids[4].tolist() == [8, 9, 10, 11]


# ---- the experts of the kernels' list and FP8 weights ----------------------------------------------


def test_fp8_decoding_of_every_byte(lib):
    """moe_experts::fp8_e4m3_to_float (the CUDA GEMMs' and the host kernel's decoder) on all 256
    codes: torch's float8_e4m3fn values (subnormals, both zeros, +-448), NaN for the two NaN codes."""
    q = torch.arange(256, dtype=torch.uint8)
    out = torch.full((256,), 7.0)
    f = lib.dinfer_fp8_e4m3_to_float
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    f(_ptr(q), _ptr(out), 256)
    want = q.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    ok = ~want.isnan()
    assert torch.equal(out[ok], want[ok]) and torch.equal(out[ok].signbit(), want[ok].signbit())


EXPERT_SHAPES = [  # El, H, I, S: S below, equal to, past I, not a multiple of it; partial scale blocks
    (3, 136, 40, 24),
    (2, 64, 32, 32),
    (2, 130, 48, 300),
    (1, 256, 160, 129),
    (4, 8, 8, 1),
]


@pytest.mark.parametrize("El,H,I,S", EXPERT_SHAPES)
def test_moe_expert_slices_read_the_contracts_weights(lib, El, H, I, S):
    """Every expert of the kernels' list, gathered through moe_experts.h's offsets and scale indices,
    is the contract's: local expert e the dequantised w13[e] / w2[e]; virtual expert j of the shared
    expert its intermediate columns [j I, j I + width) (gate rows, up rows S + j I.., w2 columns), the
    virtual experts covering S exactly once."""
    from dinfer_kernels import fp8_block_dequantize, fp8_block_quantize

    q13, s13 = fp8_block_quantize(torch.randn(El, 2 * I, H), halves=2)
    q2, s2 = fp8_block_quantize(torch.randn(El, H, I))
    qs13, ss13 = fp8_block_quantize(torch.randn(2 * S, H), halves=2)
    qs2, ss2 = fp8_block_quantize(torch.randn(H, S))
    w13 = fp8_block_dequantize(q13, s13, torch.float32, halves=2)
    w2 = fp8_block_dequantize(q2, s2, torch.float32)
    sw13 = fp8_block_dequantize(qs13, ss13, torch.float32, halves=2)
    sw2 = fp8_block_dequantize(qs2, ss2, torch.float32)
    f = lib.dinfer_moe_expert_on_host
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [i64] * 5 + [vp] * 11
    f.restype = i64
    nv = -(-S // I)
    covered = []
    for x in range(El + nv):
        width = I if x < El else min(I, S - (x - El) * I)
        gate = torch.full((width, H), float("nan"))
        up, down = torch.full_like(gate, float("nan")), torch.full((H, width), float("nan"))
        bytes_ = [t.view(torch.uint8) for t in (q13, q2)] + [s13, s2]
        shared = [t.view(torch.uint8) for t in (qs13, qs2)] + [ss13, ss2]
        got = f(x, El, H, I, S, *map(_ptr, bytes_ + shared + [gate, up, down]))
        assert got == width
        if x < El:
            want = w13[x, :I], w13[x, I:], w2[x]
        else:
            c0 = (x - El) * I
            covered += list(range(c0, c0 + width))
            want = sw13[c0 : c0 + width], sw13[S + c0 : S + c0 + width], sw2[:, c0 : c0 + width]
        for name, out, ref in zip(("gate", "up", "down"), (gate, up, down), want):
            assert torch.equal(out, ref), f"expert {x}: {name}"
    assert covered == list(range(S))


@pytest.mark.parametrize("T,k,S,I", [(5, 2, 0, 8), (7, 3, 24, 8), (1, 1, 9, 8), (13, 8, 512, 512)])
def test_moe_entries_of_the_virtual_experts(lib, T, k, S, I):
    """Entries t k + slot (routed) then T k + j T + t (token t of virtual expert j): the token of
    each, and virtual_entry inverts it."""
    f = lib.dinfer_moe_entries_on_host
    i64 = ctypes.c_int64
    f.argtypes = [i64, i64, i64, i64, ctypes.c_void_p]
    f.restype = ctypes.c_int32
    nv = -(-S // I) if S else 0
    token = torch.full((T * (k + nv),), -7, dtype=torch.int64)
    assert f(T, k, S, I, _ptr(token)) == nv
    want = torch.cat([torch.arange(T).repeat_interleave(k), torch.arange(T).repeat(nv)])
    assert torch.equal(token, want)


# ---- the shared scalar math ------------------------------------------------------------------------


def ulps(out, truth):
    """|out - truth| in units of fp32's spacing at truth (subnormal spacing below 2^-126)."""
    t = truth.abs().clamp_min(2.0**-126)
    spacing = 2.0 ** (torch.floor(torch.log2(t)) - 23)
    return ((out.double() - truth) / spacing).abs()


def shared_math(lib, fn, x, y=None):
    f = lib.dinfer_shared_math
    f.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    out = torch.full_like(x, float("nan"))
    f(fn, _ptr(x), _ptr(y if y is not None else x), _ptr(out), x.numel())
    return out


def test_shared_exp_sigmoid_silu_ulps(lib):
    """The one exp of SiLU, sigmoid, the MoE router and the host softmaxes (scalar::exp_nonpositive),
    on both host and device: within 2 ulp of exp over [-87.3, 0] (measured max: 1), 0 below, NaN kept.
    sigmoid within 3 ulp, silu(g) * u within 4 ulp of fp64 (measured: 2 and 3). The device's attention
    and decode inner loops deliberately use MUFU.EX2 instead (scalar::fast_exp2: <= 2 ulp by the PTX
    ISA, ~1 instruction against ~12): only its host stand-in exp2f runs here."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            -torch.rand(1 << 20, generator=g) * 87.3,
            -torch.logspace(-30, 1.94, 4096),
            torch.tensor([0.0, -0.0, -87.29, -1e-45]),
        ]
    )
    assert ulps(shared_math(lib, 0, x), torch.exp(x.double())).max() <= 2
    low = torch.tensor([-87.31, -100.0, -1e30, float("-inf")])
    assert (shared_math(lib, 0, low) == 0).all()
    assert shared_math(lib, 0, torch.tensor([float("nan")])).isnan().all()

    # Below x = -87.3, exp(x) flushes to 0: sigmoid loses < exp(-87.3) < 2^-125, silu < |g u| 2^-125.
    s = torch.cat(
        [(torch.rand(1 << 18, generator=g) - 0.5) * 200, torch.tensor([0.0, 88.0, -88.0, 1e30, -1e30])]
    )
    u = torch.randn(s.numel(), generator=g)
    flush = s < -87.3
    sig, sig_truth = shared_math(lib, 1, s), torch.sigmoid(s.double())
    assert ulps(sig[~flush], sig_truth[~flush]).max() <= 3
    assert ((sig.double() - sig_truth).abs() <= 2.0**-125)[flush].all()
    silu = shared_math(lib, 2, s, u)
    truth = s.double() * sig_truth * u.double()
    assert ulps(silu[~flush], truth[~flush]).max() <= 4
    assert ((silu.double() - truth).abs() <= (s.double() * u.double()).abs() * 2.0**-125)[flush].all()
    inf = torch.tensor([float("inf"), float("-inf"), float("nan")])
    assert shared_math(lib, 1, inf)[:2].tolist() == [1.0, 0.0] and shared_math(lib, 1, inf)[2].isnan()


# ---- attention: key walks of the splits, and the split combine --------------------------------------


def emulated_walk(lib, S, seq_len, kv_block, *, blocks=None, count=None, mass=False, units=1):
    """(tiles [(split, kb, k0, k1, last)], num_splits) of one work unit's key list."""
    f = lib.dinfer_attention_walk_on_host
    i32, i64, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    f.argtypes = [vp, i32, i32, i32, i32, i32, i32, i64, vp, i64, vp]
    f.restype = i64
    lst = None if blocks is None else torch.tensor(blocks, dtype=torch.int32)
    out = torch.full((4096, 5), -7, dtype=torch.int32)
    ns = torch.zeros(1, dtype=torch.int32)
    n = f(
        _ptr(lst),
        0 if count is None else count,
        0 if lst is None else lst.numel(),
        seq_len,
        S,
        kv_block,
        int(mass),
        units,
        _ptr(out),
        out.shape[0],
        _ptr(ns),
    )
    assert n <= out.shape[0]
    return [tuple(r) for r in out[:n].tolist()], int(ns)


def expected_walk(S, seq_len, kv_block, blocks, count, mass):
    """The keys the reference attends, as the kernel's 64-key tiles, in list order."""
    L = max(0, min(seq_len, S))
    if blocks is None:
        wkb = kv_block if mass else 64
        slots = list(range(-(-L // wkb)))
    else:
        wkb = kv_block
        slots = blocks[: max(0, min(count, len(blocks)))]
    nkb = -(-S // wkb)
    tiles = []
    for kb in slots:
        if not 0 <= kb < nkb:
            continue
        bs, be = kb * wkb, min(kb * wkb + wkb, L)
        for k0 in range(bs, be, 64):
            tiles.append((kb, k0, min(k0 + 64, be), int(min(k0 + 64, be) >= be)))
    return tiles


WALK_CASES = [
    # S, seq_len, kv_block, blocks, count, mass
    (1000, 999, 64, None, None, False),
    (1000, 1000, 100, None, None, True),
    (4096, 0, 128, None, None, False),
    (300, -3, 64, None, None, True),
    (300, 5000, 32, None, None, False),  # seq_len past the cache: clamped to S
    (2048, 2048, 128, [15, 3, 7, 0, 9], 5, False),
    (2048, 1500, 128, [15, 3, 7, 0, 9], 5, True),  # block 15 past L: skipped
    (1000, 1000, 100, [9, -1, 10, 1_000_000, 2, 4], 6, False),  # invalid ids skipped
    (1000, 1000, 100, [1, 2, 3, 4, 5, 6], 3, True),  # entries past the count are never read
    (1000, 1000, 100, [1, 2, 3], 99, False),  # count past max_blocks: clamped
    (1000, 1000, 100, [1, 2, 3], -4, False),
    (100, 100, 1000, [0], 1, True),  # one block larger than the cache
    (8192, 8191, 256, list(range(31, -1, -1)), 32, False),
]


@pytest.mark.parametrize("case", range(len(WALK_CASES)))
@pytest.mark.parametrize("units", [1, 20, 264])
def test_attention_key_walk_covers_each_listed_key_once(lib, case, units):
    S, seq_len, kv_block, blocks, count, mass = WALK_CASES[case]
    tiles, ns = emulated_walk(lib, S, seq_len, kv_block, blocks=blocks, count=count, mass=mass, units=units)
    assert 1 <= ns <= 32 and (units < 264 or ns == 1)
    assert [t[1:] for t in tiles] == expected_walk(S, seq_len, kv_block, blocks, count, mass)
    splits = [t[0] for t in tiles]
    assert splits == sorted(splits)
    if mass:  # block statistics need each block's tiles in one split
        owner = {}
        for split, kb, *_ in tiles:
            assert owner.setdefault(kb, split) == split


def emulated_combine(lib, part_lse, part_o):
    f = lib.dinfer_attention_combine_on_host
    vp, i32 = ctypes.c_void_p, ctypes.c_int32
    f.argtypes = [vp, vp, i32, i32, i32, vp, vp]
    ns, rows, D = part_o.shape
    out = torch.full((rows, D), float("nan"))
    lse2 = torch.full((rows,), float("nan"))
    assert f(_ptr(part_lse), _ptr(part_o), ns, rows, D, _ptr(out), _ptr(lse2)) == 0
    return out, lse2


@pytest.mark.parametrize("ns", [1, 2, 5, 32])
@pytest.mark.parametrize("D", [64, 128])
def test_attention_split_combine(lib, ns, D):
    """The (O, lse) partials of the splits merge into softmax-weighted sums; splits without keys
    (lse -inf) contribute nothing, a row without any key gets lse -inf and output 0, and a split's
    NaN (its softmax undefined) makes the whole row NaN."""
    rows = 7
    part_lse = torch.randn(ns, rows) * 8
    part_lse[0, 1] = float("-inf")
    part_lse[:, 2] = float("-inf")
    part_lse[-1, 3] = 130.0  # 2^130 overflows fp32: the max shift must keep it finite
    part_lse[-1, 4] = float("nan")  # fmaxf would drop it
    part_lse[:, 5] = float("nan")
    part_o = torch.randn(ns, rows, D)
    out, lse2 = emulated_combine(lib, part_lse, part_o)
    ln2 = torch.log(torch.tensor(2.0, dtype=torch.float64))

    def merged(ls, o):
        w = torch.softmax(ls * ln2.to(ls.dtype), 0).nan_to_num(0.0)
        return (w[:, :, None] * o).sum(0), torch.logsumexp(ls * ln2.to(ls.dtype), 0) / ln2.to(ls.dtype)

    same_out, same_lse = merged(part_lse, part_o)
    truth_out, truth_lse = merged(part_lse.double(), part_o.double())
    nan = part_lse.isnan().any(0)
    live = part_lse.isfinite().any(0) & ~nan
    assert_precision(out[live], same_out[live], truth_out[live], "combined output")
    assert_precision(lse2[live], same_lse[live], truth_lse[live], "combined lse")
    assert out[nan].isnan().all() and lse2[nan].isnan().all()
    empty = ~live & ~nan
    assert (out[empty] == 0).all() and (lse2[empty] == float("-inf")).all()


# ---- attention: the paged layout's address translation ------------------------------------------------


def emulated_kv_offsets(lib, table, page_size, num_pages, strides, head, B=None, S=None):
    """[B, S] int64: the kernels' element offset of each position's cache row (head `head`), -1 where
    absent; table None: contiguous caches of S positions."""
    f = lib.dinfer_attention_kv_offsets_on_host
    i64, i32, vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    f.argtypes = [vp, i64, i64, i32, i64, vp, i64, vp]
    f.restype = None
    if table is not None:
        B, MP = table.shape
    else:
        MP, page_size = 1, S
    st = torch.tensor(strides, dtype=torch.int64)
    out = torch.full((B, MP * page_size), -7, dtype=torch.int64)
    f(_ptr(table), B, MP, page_size, num_pages, _ptr(st), head, _ptr(out))
    return out


@pytest.mark.parametrize("page_size", [1, 3, 16, 32])
@pytest.mark.parametrize("strided", [False, True])
def test_attention_paged_translation(lib, page_size, strided):
    """Each position of each sequence maps to the reference's pool row (reference.attention.paged_rows:
    page block_table[b, s // page_size], row s % page_size), through the pool's strides; ids outside
    [0, P) (-3..-1, P..P+2, INT32_MIN / MAX) make the position absent."""
    B, MP, P, H, D = 3, 7, 11, 2, 8
    g = torch.Generator().manual_seed(page_size)
    table = torch.randint(-3, P + 3, (B, MP), generator=g, dtype=torch.int32)
    table[0, 0], table[1, -1] = torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max
    row = H * D
    strides = (page_size * row + (24 if strided else 0), row, D)  # a padded page stride: a strided pool
    got = emulated_kv_offsets(lib, table, page_size, P, strides, head=1)
    rows, present = paged_rows(table, P, page_size)
    want = (rows // page_size) * strides[0] + (rows % page_size) * strides[1] + strides[2]
    assert torch.equal(got, torch.where(present, want, -1))
    assert (~present).sum() > 0 and present.sum() > 0
    # contiguous caches: (b, s) itself
    S = MP * page_size
    got = emulated_kv_offsets(lib, None, 0, 0, (S * row + 8, row, D), head=0, B=B, S=S)
    assert torch.equal(got, torch.arange(B)[:, None] * (S * row + 8) + torch.arange(S)[None, :] * row)


# ---- hostile inputs under AddressSanitizer ---------------------------------------------------------


def hostile_inputs(so):
    """Values the kernels must survive without an out-of-bounds access (run under ASan): bad
    sequence offsets, credit ids outside [0, V), a mask id outside the vocabulary, block lists with
    invalid ids and counts. Buffers are exactly sized, so any read past them is reported."""
    lib = ctypes.CDLL(so)
    decode_step = emulated_decode_step(lib)
    N, V, K = 9, 1031, 3
    full = torch.randn(N, V + 3)
    logits = full[:, 1 : V + 1]  # misaligned rows, the last one ending 2 elements before the buffer
    for offsets, mask_id in (([-5, 3, 2, 100], 7), ([0, 4, 9], V + 5), ([9, 0, -1, 4], -2)):
        offs = torch.tensor(offsets, dtype=torch.int32)
        B = offs.numel() - 1
        tokens = torch.full((N,), 7, dtype=torch.int64)
        before = tokens.clone()
        ids = torch.randint(-3, V + 3, (N, K), dtype=torch.int32)
        ids[N - 1, K - 1] = 2**31 - 1
        vals = torch.rand(N, K)
        outs = [
            torch.full((N,), -7, dtype=torch.int64),
            torch.full((N,), float("nan")),
            torch.zeros(N, dtype=torch.bool),
        ]
        editable = torch.rand(N) < 0.5  # exactly [N]: a read past it is reported
        for rule in range(4):
            params = decode_params(
                mask_id,
                rule=decode_checks.RULES[rule],
                threshold=torch.rand(B),
                low_threshold=0.4,
                num_commit=torch.randint(0, 3, (B,), dtype=torch.int32),
                temperature=0.5 * rule,
                seed=1,
                offset=2,
                credit_alpha=0.7,
                credit_beta=0.8,
                credit_gamma=0.2,
                editable=editable if rule == 3 else None,
                edit_threshold=0.01 if rule == 3 else None,
            )
            decode_step(logits, tokens, offs, ids, vals, *outs, None, params)  # None: no non-finite flags
        covered = torch.zeros(N, dtype=torch.bool)
        for b in range(B):  # the rows the kernels' clamp assigns to a sequence
            lo = min(max(offsets[b], 0), N)
            covered[lo : min(max(offsets[b + 1], lo), N)] = True
        assert (outs[0][~covered] == -7).all() and torch.equal(tokens[~covered], before[~covered])
        assert ((ids == -1) | ((ids >= 0) & (ids < V)))[covered].all()  # bad ids became empty slots
    for blocks, count in (([5, -1, 99, 2], 4), ([1, 2], 7), ([3], -1)):
        emulated_walk(lib, 640, 600, 64, blocks=blocks, count=count, mass=True)
    # block tables of any ids, exactly sized: only their own entries are read
    i32 = torch.iinfo(torch.int32)
    for page_size in (1, 3, 32):
        table = torch.tensor([[i32.min, -1, 5], [i32.max, 2, 0]], dtype=torch.int32)
        emulated_kv_offsets(lib, table, page_size, 3, (page_size * 64, 64, 8), head=1)
    logits = torch.randn(3, 8)
    logits[1] = float("nan")
    emulated_route(lib, logits, 2, num_groups=4, topk_groups=1, e0=2, e1=6)


@pytest.mark.skipif(
    not Path(
        subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    ).exists()
    if shutil.which("g++")
    else True,
    reason="needs libasan",
)
def test_hostile_inputs_stay_in_bounds(tmp_path):
    so = tmp_path / "device_logic_asan.so"
    build(so, "-fsanitize=address", "-fno-omit-frame-pointer")
    asan = subprocess.run(
        ["g++", "-print-file-name=libasan.so"], capture_output=True, text=True
    ).stdout.strip()
    # The test modules import the shared conftest from tests/, one level above their own folder.
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    env = dict(
        os.environ,
        LD_PRELOAD=asan,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0:exitcode=99",
        PYTHONPATH=path,
    )
    proc = subprocess.run(
        [sys.executable, "-c", f"import test_device_logic as t; t.hostile_inputs({str(so)!r})"],
        cwd=Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
