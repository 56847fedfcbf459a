"""dinfer_kernels.fp8: fp8_block_quantize / fp8_block_dequantize against a straightforward loop over
the 128 x 128 blocks (each half of a gate/up stack blocked on its own), on awkward shapes, zero
blocks and bad input."""

import pytest
import torch

import dinfer_kernels as dk
from dinfer_kernels.fp8 import FP8_DTYPE, FP8_MAX

B = dk.FP8_BLOCK


def _blocks(rows, cols, halves):
    """(row slice, column slice, scale row, scale column) of every block, in scale order."""
    half = rows // halves
    per_half = -(-half // B)
    for h in range(halves):
        for rb in range(per_half):
            r = slice(h * half + rb * B, min(h * half + (rb + 1) * B, (h + 1) * half))
            for cb in range(-(-cols // B)):
                yield r, slice(cb * B, min((cb + 1) * B, cols)), h * per_half + rb, cb


def loop_quantize(w, halves=1):
    """The quantisation block by block: scale = absmax / 448 (1 for an all-zero block)."""
    rows, cols = w.shape[-2:]
    lead = w.shape[:-2]
    n_rb = halves * -(-(rows // halves) // B)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    scale = torch.empty(*lead, n_rb, -(-cols // B))
    for i in range(w[..., 0, 0].numel()):
        at = tuple(torch.unravel_index(torch.tensor(i), lead)) if lead else ()
        at = tuple(int(x) for x in at)
        for r, c, sr, sc in _blocks(rows, cols, halves):
            block = w[at][r, c].float()
            amax = float(block.abs().max())
            s = torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float32)
            scale[at][sr, sc] = s
            q[at][r, c] = (block / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def loop_dequantize(q, scale, dtype, halves=1):
    rows, cols = q.shape[-2:]
    out = torch.empty(q.shape, dtype=dtype)
    for r, c, sr, sc in _blocks(rows, cols, halves):
        out[..., r, c] = (q[..., r, c].float() * scale[..., sr, sc, None, None]).to(dtype)
    return out


SHAPES = [  # (leading dims, rows, cols, halves)
    ((), 1, 1, 1),
    ((), 1, 131, 1),
    ((), 7, 13, 1),
    ((), 129, 257, 1),  # one past a block each way
    ((), 256, 128, 1),  # exact blocks
    ((3,), 2 * 72, 200, 2),  # a gate/up stack, I = 72: each half one partial block row
    ((2,), 2 * 130, 131, 2),  # I = 130: the up half starts mid-block of the plain grid
    ((2, 2), 2, 3, 2),  # I = 1
    ((), 2 * 257, 5, 2),
]


def _weights(lead, rows, cols, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Magnitudes spread over decades, so blocks get different scales and e4m3 subnormals occur.
    w = torch.randn(*lead, rows, cols, generator=g) * 10 ** torch.randint(
        -4, 2, (*lead, rows, 1), generator=g
    )
    return w.to(dtype)


@pytest.mark.parametrize("lead,rows,cols,halves", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_the_block_loop(lead, rows, cols, halves, dtype):
    w = _weights(lead, rows, cols, dtype)
    q, scale = dk.fp8_block_quantize(w, halves=halves)
    want_q, want_scale = loop_quantize(w, halves)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.is_contiguous()
    assert scale.shape == want_scale.shape
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("lead,rows,cols,halves", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_matches_the_block_loop(lead, rows, cols, halves, dtype):
    q, scale = dk.fp8_block_quantize(_weights(lead, rows, cols, torch.float32, seed=1), halves=halves)
    got = dk.fp8_block_dequantize(q, scale, dtype, halves=halves)
    want = loop_dequantize(q, scale, dtype, halves)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("lead,rows,cols,halves", SHAPES)
def test_round_trip_error_is_e4m3_rounding(lead, rows, cols, halves):
    """Each element comes back within half an e4m3 step: 2^-4 relative (3 mantissa bits), or half
    the smallest subnormal (2^-10 of its block's scale) near zero."""
    w = _weights(lead, rows, cols, torch.float32, seed=2)
    q, scale = dk.fp8_block_quantize(w, halves=halves)
    back = dk.fp8_block_dequantize(q, scale, torch.float64, halves=halves)
    per_element = dk.fp8_block_dequantize(torch.ones_like(q), scale, torch.float64, halves=halves)
    err = (back - w.double()).abs()
    limit = w.double().abs() * 2**-4 + per_element * 2**-10
    assert (err <= limit * (1 + 2**-20)).all()


def test_zero_blocks_get_scale_one():
    w = torch.randn(2 * 200, 300)
    w[:128, 128:256] = 0  # a whole block of the gate half
    w[200:328, 256:] = 0  # the up half's first block row, last (partial) column block
    q, scale = dk.fp8_block_quantize(w, halves=2)
    assert scale[0, 1] == 1 and scale[2, 2] == 1
    assert (q[:128, 128:256].float() == 0).all() and (q[200:328, 256:].float() == 0).all()
    assert (scale[scale != 1] < 1).all()  # the others: absmax / 448
    assert (dk.fp8_block_dequantize(q, scale, torch.float32, halves=2)[:128, 128:256] == 0).all()
    q, scale = dk.fp8_block_quantize(torch.zeros(3, 5))
    assert scale.tolist() == [[1.0]] and not q.float().any()


def test_bad_inputs_name_the_argument():
    w = torch.randn(6, 5)
    q, scale = dk.fp8_block_quantize(w)
    cases = [
        (lambda: dk.fp8_block_quantize(w.long()), "w"),
        (lambda: dk.fp8_block_quantize(w[0]), "w"),
        (lambda: dk.fp8_block_quantize(torch.randn(5, 4), halves=2), "w"),
        (lambda: dk.fp8_block_quantize(w, halves=0), "halves"),
        (lambda: dk.fp8_block_quantize(w, halves=2.0), "halves"),
        (lambda: dk.fp8_block_dequantize(w, scale, torch.float32), "q"),
        (lambda: dk.fp8_block_dequantize(q, scale.half(), torch.float32), "scale"),
        (lambda: dk.fp8_block_dequantize(q, scale[:, :0], torch.float32), "scale"),
        (lambda: dk.fp8_block_dequantize(q, scale[None], torch.float32), "scale"),
        (lambda: dk.fp8_block_dequantize(q, scale, torch.float32, halves=2), "scale"),  # 2 block rows
        (lambda: dk.fp8_block_dequantize(q.view(3, 2, 5), scale, torch.float32), "scale"),
    ]
    for call, name in cases:
        with pytest.raises((ValueError, TypeError), match=f"^{name}"):
            call()
    q, scale = dk.fp8_block_quantize(torch.randn(200, 300))
    with pytest.raises(ValueError, match="^scale"):
        dk.fp8_block_dequantize(q, scale.t().contiguous().t(), torch.float32)  # not contiguous
