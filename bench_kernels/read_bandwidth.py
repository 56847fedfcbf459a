"""The read-only bandwidth yardstick's kernel: every program of a persistent grid sums its share of a
float32 buffer and writes one partial sum, so the kernel reads the whole buffer and writes almost
nothing. timing.read_bandwidth times it on a buffer many times the L2 (its reads come from HBM).

Why beside the copy yardstick: `dst.copy_(src)` mixes reads with as many writes and read 58 % of the
H200's datasheet bandwidth in the 802ee3b run, while the MoE kernel, which only streams weights, read
68 %: a copy understates what a kernel that reads can get. This kernel is what those kernels do.
"""

import torch
import triton
import triton.language as tl

BLOCK = 8192  # floats per program and step: 32 per thread of 8 warps, 8 independent 16-byte loads
WARPS = 8


@triton.jit
def _partial_sums(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # Program p reads blocks p, p + P, p + 2P, ...: at each step the grid reads one contiguous span.
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def partial_sums(x, out, block=BLOCK):
    """out[p] = the sum of the blocks p, p + P, p + 2P, ... of `block` elements of the contiguous float32
    vector x (the last block cut at x's end), for the P = out.numel() programs; x.numel() < 2**31."""
    for name, t in (("x", x), ("out", out)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name}: a contiguous float32 vector, got {t.dtype} of shape {tuple(t.shape)}")
    if x.numel() >= 2**31:
        raise ValueError(f"x: at most 2**31 - 1 elements (int32 offsets), got {x.numel()}")
    _partial_sums[(out.numel(),)](x, out, x.numel(), BLOCK=block, num_warps=WARPS)
    return out
