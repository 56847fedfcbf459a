"""rms_norm in Triton. Contract: dinfer_kernels/reference/rms_norm.py.

One program per block of ROWS rows: the sum of squares in fp32 over the row in BLOCK_D chunks, then a
second pass that scales, rounds to the dtype (the reference rounds before the weight multiply),
multiplies by the weight and stores. One launch, no workspace, capturable; rows of any stride.
"""

import triton
import triton.language as tl

MAX_BLOCK_D = 4096  # one chunk up to this width (LLaDA-MoE's hidden is 2048); longer rows loop


@triton.jit
def _rms_norm_kernel(x, stride_x, w, out, stride_o, N, D, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < N
    xr = x + r.to(tl.int64)[:, None] * stride_x
    total = tl.zeros([ROWS], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        v = tl.load(xr + d[None, :], mask=live[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        total += tl.sum(v * v, axis=1)
    inv = 1.0 / tl.sqrt(total / D + eps)
    orow = out + r.to(tl.int64)[:, None] * stride_o
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = live[:, None] & (d < D)[None, :]
        v = tl.load(xr + d[None, :], mask=m, other=0.0).to(tl.float32)
        y = (v * inv[:, None]).to(out.dtype.element_ty).to(tl.float32)  # rounded before the weight
        g = tl.load(w + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(orow + d[None, :], (y * g[None, :]).to(out.dtype.element_ty), mask=m)


def rms_norm(x, weight, out, *, eps: float) -> None:
    """Writes out (contiguous, x's shape and dtype): the normalised rows of x [..., D], on any device
    Triton runs on."""
    if x.numel() == 0:
        return
    D = x.shape[-1]
    rows = x.reshape(-1, D)
    if D > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    N = rows.shape[0]
    block_d = min(triton.next_power_of_2(D), MAX_BLOCK_D)
    per_program = max(1, min(16, 4096 // block_d))  # small rows: several per program
    grid = (triton.cdiv(N, per_program),)
    _rms_norm_kernel[grid](
        rows,
        rows.stride(0),
        weight.contiguous(),
        out.view(-1, D),
        D,
        N,
        D,
        float(eps),
        ROWS=per_program,
        BLOCK_D=block_d,
    )
