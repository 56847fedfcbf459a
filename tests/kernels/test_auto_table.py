"""backend="auto" on the host per dtype and shape: the MoE choice follows the measured table of
dinfer_kernels/_backend.py (MOE_HOST_WINS), and dinfer_kernels.moe passes it the call's dtype and
shape. What the table says, not timings: the timings behind it are in docs/notes/results-log.md."""

import pytest
import torch
from conftest import EXT

import dinfer_kernels as dk
from dinfer_kernels import _backend
from dinfer_kernels.ops import moe as moe_op

pytestmark = pytest.mark.skipif(
    EXT is None or not hasattr(EXT, "cpu_isa"), reason="the extension with per-ISA host kernels is not built"
)

CPU = torch.device("cpu")
LLADA_MOE_BYTES = 64 * 3 * 2048 * 1024  # elements of w13 + w2 at E 64, H 2048, I 1024
X86_ISAS = ("avx2", "avx512", "avx512bf16")


def auto_moe(dtype, rows_per_expert, weight_elems):
    return _backend.resolve(
        "auto",
        CPU,
        "moe",
        dtype=dtype,
        rows_per_expert=rows_per_expert,
        weight_bytes=weight_elems * torch.empty((), dtype=dtype).element_size(),
    )


def test_moe_choice_per_dtype_and_shape(host_isa):
    isa = _backend.cpu_isa()
    if isa not in _backend.MOE_HOST_WINS:
        pytest.skip(f"no MoE measurements for {isa}")
    # LLaDA-MoE at T = 32 (4 rows per expert): bf16 and fp16 lose to torch's GEMMs on every copy, fp32
    # wins on every copy; at T = 4 (0.5 rows per expert) bf16 wins where the ISA converts in registers.
    assert auto_moe(torch.bfloat16, 4, LLADA_MOE_BYTES) == "torch"
    assert auto_moe(torch.float16, 4, LLADA_MOE_BYTES) == "torch"
    assert auto_moe(torch.float32, 4, LLADA_MOE_BYTES) == "cpu"
    assert auto_moe(torch.bfloat16, 0.5, LLADA_MOE_BYTES) == ("cpu" if isa in X86_ISAS else "torch")
    # Small experts: the host kernel wins with few rows per expert, torch's GEMMs with many.
    small = 8 * 3 * 256 * 128
    assert auto_moe(torch.float32, 4, small) == "cpu"
    assert auto_moe(torch.float32, 32, small) == ("cpu" if isa in X86_ISAS else "torch")
    assert auto_moe(torch.float32, 128, small) == "torch"
    assert auto_moe(torch.bfloat16, 128, small) == ("cpu" if isa == "avx512bf16" else "torch")
    # An explicit choice always runs what it names; without a shape the op-level answer stands.
    assert (
        _backend.resolve(
            "cpu", CPU, "moe", dtype=torch.bfloat16, rows_per_expert=4, weight_bytes=2 * LLADA_MOE_BYTES
        )
        == "cpu"
    )
    assert _backend.resolve("auto", CPU, "moe") == "cpu"


def test_moe_choice_with_fp8_weights(host_isa):
    """FP8 weights take the table's float8_e4m3fn row whatever the hidden dtype: the host kernel wins
    up to the rows per expert measured (the reference dequantises every chosen expert per call)."""
    isa = _backend.cpu_isa()
    if isa not in _backend.MOE_HOST_WINS:
        pytest.skip(f"no MoE measurements for {isa}")

    def auto(dtype, rows, elems):
        return _backend.resolve(
            "auto",
            CPU,
            "moe",
            dtype=dtype,
            rows_per_expert=rows,
            weight_bytes=elems,
            weight_dtype=torch.float8_e4m3fn,
        )

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert auto(dtype, 4, LLADA_MOE_BYTES) == "cpu"  # 16-bit weights: torch there (above)
        assert auto(dtype, 32, 8 * 3 * 256 * 128) == "cpu"
        assert auto(dtype, 1000, 8 * 3 * 256 * 128) == "torch"  # past what was measured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_call_takes_its_shape_into_account(host_isa, dtype, monkeypatch):
    """dk.moe(backend="auto") runs the backend the table names for its own T, E, top-k and weights."""
    ran = []
    reference = moe_op.moe_reference
    monkeypatch.setattr(moe_op, "moe_reference", lambda *a, **k: ran.append("torch") or reference(*a, **k))
    from dinfer_kernels.cpu import moe as cpu_moe

    kernel = cpu_moe.moe
    monkeypatch.setattr(cpu_moe, "moe", lambda *a, **k: ran.append("cpu") or kernel(*a, **k))
    E, H, inter, k = 8, 64, 32, 8
    w13 = torch.randn(E, 2 * inter, H).to(dtype)
    w2 = torch.randn(E, H, inter).to(dtype)
    router = torch.randn(E, H)
    weight_bytes = (w13.numel() + w2.numel()) * w13.element_size()
    for T, expected in ((4, "cpu"), (64, None), (256, "torch")):  # rows per expert = T (all 8 experts)
        if expected is None:
            expected = "cpu" if _backend.moe_host_wins(dtype, T, weight_bytes) else "torch"
        ran.clear()
        dk.moe(torch.randn(T, H).to(dtype), router, w13, w2, k)
        assert ran == [expected], (T, ran)
