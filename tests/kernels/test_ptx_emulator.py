"""The tensor-core kernels' data movement and fragment logic, executed lane by lane on the CPU.

tests/kernels/ptx_emu/ is a model of the PTX the CUDA kernels use (ldmatrix x1/x2/x4 and .trans,
mma.sync.m16n8k16 bf16/fp16 -> fp32, cp.async groups and barriers, shared-memory banks), written
from the PTX ISA's fragment tables. It is driven by the kernels' own offset and fragment formulas
(csrc/include/dinfer_kernels/detail/mma_layout.h, which attention.cu and moe.cu call) through the
kernels' loop nests, for every tile configuration they use: the attention forward tile (D = 64 and
128: Q K^T, then P V with .trans loads of V) and the four MoE GEMM configurations, with b16 and with
FP8 weights (staged e4m3 bytes, each thread converting its own chunks into the b16 tile between two
barriers). Each tile
product must equal the fp64 matmul exactly (inputs are small integers), with no hazard and no bank
conflict; each deliberate mutation of the formulas or of the pipeline must be caught.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT

EMU = Path(__file__).resolve().parent / "ptx_emu"

TILES = [
    ("attention", "D64"),
    ("attention", "D128"),
    ("moe", "SmallGemm1"),
    ("moe", "SmallGemm2"),
    ("moe", "LargeGemm1"),
    ("moe", "LargeGemm2"),
    # FP8 weights: e4m3 bytes staged by cp.async, dequantised by their copier into the b16 tile
    ("moe", "SmallGemm1Fp8"),
    ("moe", "SmallGemm2Fp8"),
    ("moe", "LargeGemm1Fp8"),
    ("moe", "LargeGemm2Fp8"),
]
DTYPES = ["bf16", "fp16"]
HAZARDS = ["inflight_read", "unsynced_read", "war", "double_copy", "bad_address", "exit_inflight"]


def _wrong(r):
    return r["mismatches"] > 0


def _misplaced(r):
    return r["mismatches"] > 0 and r["unwritten"] + r["out_of_tile"] > 0


def _raced(r):
    return r["inflight_read"] > 0 and r["mismatches"] > 0


def _unsynced(r):
    return r["war"] + r["unsynced_read"] > 0


def _overran(r):
    # Past the allocation; or, with FP8 weights, into the converted tile that follows the stages,
    # where copies of the shifted stage race the conversion's stores.
    return r["bad_address"] > 0 or (r["mismatches"] > 0 and r["double_copy"] > 0)


def _conflicted(r):
    return r["ldmatrix_wavefronts"] > r["ldmatrix_phases"]


# mutation -> (what must catch it, tiles it applies to)
MUTATIONS = {
    "swap_lanes": (_wrong, TILES),  # two lanes' ldmatrix addresses swapped
    "write_unswizzled": (_wrong, TILES),  # cp.async writes without the swizzle
    "row_off_by_one": (_misplaced, TILES),  # epilogue rows shifted by one
    "no_trans": (_wrong, TILES[:2]),  # V loaded without .trans
    "no_wait": (_raced, TILES),  # cp.async.wait_group left out
    "shallow_wait": (_raced, TILES),  # one group too few waited for
    "no_barrier": (_unsynced, TILES),  # the barrier before a refill left out
    "buffer_overrun": (_overran, TILES),  # the last K/V buffer or stage past the allocation
    "no_swizzle": (_conflicted, TILES),  # right product, 8-way bank conflicts
}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    exe = tmp_path_factory.mktemp("ptx_emu") / "tile_products"
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            f"-I{ROOT / 'csrc/include'}",
            f"-I{EMU}",
            str(EMU / "tile_products.cpp"),
            "-o",
            str(exe),
        ],
        check=True,
    )
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [json.loads(line) for line in lines]
    cases = {(r["kernel"], r["config"], r["dtype"], r["mutation"]): r for r in rows if r["kernel"] != "model"}
    model = next(r for r in rows if r["kernel"] == "model")
    print("\nshared-memory wavefronts per phase (1.00 = conflict-free):")
    for (kernel, config, dtype, mutation), r in sorted(cases.items()):
        if mutation == "none":
            print(
                f"  {kernel:9s} {config:10s} {dtype}: ldmatrix {r['ldmatrix_wavefronts'] / r['ldmatrix_phases']:.2f}"
                f" ({r['ldmatrix_phases']} phases), cp.async {r['cp_async_wavefronts'] / r['cp_async_phases']:.2f}"
                f" ({r['cp_async_phases']} phases)"
            )
    return model, cases


def test_ptx_model_is_self_consistent(emulated):
    # Fragment tables are bijections; .x1/.x2 agree with .x4; .trans of a transpose is the plain load.
    model, _ = emulated
    assert model["self_check_failures"] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,config", TILES)
def test_tile_product_is_exact(emulated, kernel, config, dtype):
    r = emulated[1][(kernel, config, dtype, "none")]
    assert (r["mismatches"], r["unwritten"], r["multi_written"], r["out_of_tile"], r["inexact"]) == (
        0,
        0,
        0,
        0,
        0,
    ), r
    assert {h: r[h] for h in HAZARDS} == {h: 0 for h in HAZARDS}, r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,config", TILES)
def test_tile_loads_are_bank_conflict_free(emulated, kernel, config, dtype):
    r = emulated[1][(kernel, config, dtype, "none")]
    assert r["ldmatrix_phases"] > 0 and r["cp_async_phases"] > 0
    assert r["ldmatrix_wavefronts"] == r["ldmatrix_phases"]
    assert r["cp_async_wavefronts"] == r["cp_async_phases"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "mutation,kernel,config", [(m, k, c) for m, (_, tiles) in MUTATIONS.items() for k, c in tiles]
)
def test_mutation_is_detected(emulated, mutation, kernel, config, dtype):
    caught, _ = MUTATIONS[mutation]
    r = emulated[1][(kernel, config, dtype, mutation)]
    assert caught(r), r
