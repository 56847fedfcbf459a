"""Index arithmetic of the Triton kernels at sizes too large to allocate: the kernels' own jit helpers,
run on scalar sizes by a probe kernel (in the interpreter without a GPU)."""

import pytest

triton = pytest.importorskip("triton")
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import HAS_GPU  # noqa: E402

from dinfer_kernels.triton.attention import _save_offsets  # noqa: E402

DEVICE = "cuda" if HAS_GPU else "cpu"


@triton.jit
def _save_offsets_probe(out, n_rows, Hkv, D: tl.constexpr):
    """out = [K offset of the last element, K-to-V distance] for a save buffer of n_rows rows."""
    last = tl.full([1, 1], D - 1, tl.int32)
    k_at, n_save = _save_offsets(n_rows - 1, n_rows, Hkv, last * 0 + (Hkv - 1), last, D)
    tl.store(out + tl.arange(0, 1), tl.reshape(k_at, [1]))
    tl.store(out + 1 + tl.arange(0, 1), tl.full([1], 0, tl.int64) + n_save)


@pytest.mark.parametrize("n_rows,Hkv,D", [(3, 2, 64), (2**21, 8, 128), (2**20 + 7, 16, 128), (2**24, 1, 512)])
def test_attention_save_buffer_offsets_are_64_bit(n_rows, Hkv, D):
    """The write_back=False save buffer is [2, B * W, Hkv, D]: its V half starts B * W * Hkv * D
    elements in, which passes 2**31 for large windows (a 32-bit product wraps negative)."""
    out = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    _save_offsets_probe[(1,)](out, n_rows, Hkv, D=D)
    assert out.tolist() == [n_rows * Hkv * D - 1, n_rows * Hkv * D]
