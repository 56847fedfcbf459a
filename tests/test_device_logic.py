"""The CUDA kernels' host-callable logic executed thread by thread on the host, against the reference.

tests/device_logic/*.cpp drive the kernels' own `__host__ __device__` functions (decode_split.h,
decode_math.h, ...) with the kernels' grids, thread striding, reduction trees and barrier order;
they are compiled here with g++ into one library loaded through ctypes, so CI without a GPU runs
the code the GPU runs (hardware exp2 / log2 approximations aside: scalar.h). The decode emulation
is a backend of tests/test_decode.py's harness (poisoned outputs, fp64 truth, precision-tied
tolerances) and runs that file's edge cases.
"""
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import test_decode
from dinfer_kernels.reference import decode_step_reference

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "tests/device_logic").glob("*.cpp"))
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
EMULATED = "cuda-on-host"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    so = tmp_path_factory.mktemp("device_logic") / "device_logic.so"
    subprocess.run(["g++", "-std=c++17", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror",
                    f"-I{ROOT / 'csrc/include'}", *map(str, SOURCES), "-o", str(so)], check=True)
    return ctypes.CDLL(str(so))


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr() if t is not None and t.numel() else 0)


def emulated_decode_step(lib):
    """The internal decode_step signature of dinfer_kernels/{cpu,cuda}/decode.py, on host tensors."""
    f = lib.dinfer_decode_step_cuda_on_host
    i64, i32, u32, flt, vp = ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_void_p
    f.argtypes = [vp, i32, i64, i64, i64, vp, vp, i64, i64, i32, vp, vp, flt, flt, u32, u32, vp, vp,
                  i32, flt, flt, flt, vp, vp, vp, vp, vp]
    f.restype = ctypes.c_int

    def decode_step(logits, tokens, seq_offsets, threshold, num_commit, credit_ids, credit_vals,
                    mask_id, rule, low_threshold, temperature, seed, offset, alpha, beta, gamma,
                    candidate, confidence, commit, row_max, row_lse):
        assert logits.stride(1) == 1 or logits.shape[1] <= 1
        N, V = logits.shape
        rc = f(_ptr(logits), DTYPES[logits.dtype], N, V, logits.stride(0) if N > 1 else V,
               _ptr(tokens), _ptr(seq_offsets), seq_offsets.numel() - 1, mask_id, rule,
               _ptr(threshold), _ptr(num_commit), low_threshold, temperature, seed, offset,
               _ptr(credit_ids), _ptr(credit_vals), credit_ids.shape[1], alpha, beta, gamma,
               _ptr(candidate), _ptr(confidence), _ptr(commit), _ptr(row_max), _ptr(row_lse))
        assert rc == 0
    return decode_step


@pytest.fixture
def emulated(lib, monkeypatch):
    """test_decode's harness, with the emulated CUDA kernels as backend EMULATED."""
    impl = emulated_decode_step(lib)
    real = test_decode.backend_impl
    monkeypatch.setattr(test_decode, "backend_impl", lambda b: impl if b == EMULATED else real(b))
    return impl


# ---- decode step -----------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", list(test_decode.RULES))
@pytest.mark.parametrize("N,V", [(1, 1), (3, 7), (2, 255), (64, 1000), (3, 32003), (5, 157184)])
def test_decode_shapes_and_rules(emulated, rule, N, V):
    """Rows shorter than one thread's vector, than a CTA's 256 threads, and the real vocabulary
    (splits whose chunks end inside a vector of the next)."""
    test_decode.test_shapes_and_rules(EMULATED, "cpu", rule, N, V)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_dtypes_and_misaligned_rows(emulated, dtype):
    test_decode.test_dtypes_and_row_stride(EMULATED, "cpu", dtype)


@pytest.mark.parametrize("case", ["test_ties_pick_lowest_index", "test_inf_nan_and_dead_rows",
                                  "test_many_sequences_and_empty_ones",
                                  "test_sampling_reproducible_per_seed"])
def test_decode_edge_cases(emulated, case):
    getattr(test_decode, case)(EMULATED, "cpu")


@pytest.mark.parametrize("rule", list(test_decode.RULES))
def test_decode_mask_predictions_and_sampling(emulated, rule):
    test_decode.test_no_mask_all_mask_and_mask_predictions(EMULATED, "cpu", rule)
    test_decode.test_sampling_matches_reference(EMULATED, "cpu", rule)


@pytest.mark.parametrize("slots", [4, 16])
def test_decode_credit(emulated, slots):
    test_decode.test_credit_over_a_block(EMULATED, "cpu", slots)


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
            outs = test_decode.check_backend(EMULATED, "cpu", logits, tokens, offsets, mask_id,
                                             "threshold")
            assert outs[0].tolist() == expected


def test_decode_bad_credit_ids_are_empty_slots(emulated):
    """Slot ids outside [0, V) are treated as empty slots, never read: the result equals the
    reference's with those slots emptied."""
    N, V, K = 6, 4099, 4
    logits, tokens, offsets, mask_id = test_decode.make_case(N, V, [0, 3, 6], masked_frac=1.0)
    ids = torch.randint(0, V, (N, K), dtype=torch.int32)
    ids[:, 1] = V
    ids[0, 2] = -5
    ids[N - 1, 3] = 2**31 - 1  # last row: past the buffer if it were read
    vals = torch.rand(N, K)
    bad = (ids < 0) | (ids >= V)
    thr, k = torch.full((2,), 0.5), torch.zeros(2, dtype=torch.int32)
    outs, tok, (ids_e, vals_e) = test_decode.run_backend(EMULATED, "cpu", logits, tokens, offsets,
                                                         mask_id, "threshold", thr, k, (ids, vals))
    ref_ids, ref_vals = ids.masked_fill(bad, -1), vals.masked_fill(bad, 0.0)
    ref = decode_step_reference(logits, tokens.clone(), offsets, mask_id, threshold=thr,
                                credit_ids=ref_ids, credit_vals=ref_vals)
    assert torch.equal(outs[0], ref.candidate) and torch.equal(ids_e, ref_ids)
    assert torch.equal(outs[2], ref.commit)
