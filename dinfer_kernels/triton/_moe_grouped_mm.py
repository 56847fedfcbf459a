"""The expert GEMMs of the Triton MoE delegated to torch._grouped_mm (CUTLASS's sm90 grouped GEMM on
Hopper), behind our routing, alignment and combine: the large-batch path of issue 40's plan, to be
chosen over our own GEMMs where a GPU run measures it faster (MoeConfig.gemm = "grouped_mm"; today
only a config override, which bench_moe times beside the default).

Launches after the routing/alignment (triton/moe.py, run with BLOCK_M = GROUPED_BLOCK_M so each
expert's rows are padded by at most 15):
  offsets   per local expert the end of its padded segment (from block_expert; static shapes)
  gather    the rows of hidden in the permuted order (padding and virtual rows take token 0: their
            results are never read)
  GEMM 1    torch._grouped_mm(rows, w13ᵀ) -> [P, 2I] in the dtype (the reference's rounding of g, u)
  silu·mul  `_silu_mul_kernel`: silu(g) * u in fp32, rounded to the dtype
  GEMM 2    torch._grouped_mm(act, w2ᵀ) -> [P, H] in the dtype (the reference's rounding of W2·a)
  scatter   `_scatter_kernel`: part[slot] = y[row] * routing weight (fp32) for the routed rows
  shared    a shared expert as two dense matmuls over all T tokens into the first virtual slot
  combine   triton/moe.py's ordered combine: bit-identical run to run, no atomics
Every shape is fixed by the call's shapes (the offsets stay on the device): CUDA-graph capturable.
bf16 / fp16 / fp32 weights (FP8 experts keep our GEMMs: _grouped_mm takes no block scales).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Rows per alignment block: _grouped_mm needs no tile padding, so the smallest block the alignment
# takes keeps the padded rows (computed, never read) under 16 per expert.
GROUPED_BLOCK_M = 16


@triton.jit
def _silu_mul_kernel(gu, act, block_expert, P, I, e_loc, BLOCK_M, BR: tl.constexpr, BI: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    e = tl.load(block_expert + rows // BLOCK_M, mask=rows < P, other=-1)
    m = ((e >= 0) & (e < e_loc))[:, None] & (cols < I)[None, :]  # rows GEMM 1 wrote
    at = rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
    g = tl.load(gu + at, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + at + I, mask=m, other=0.0).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(act + rows.to(tl.int64)[:, None] * I + cols[None, :], h.to(act.dtype.element_ty), mask=m)


@triton.jit
def _scatter_kernel(
    y,
    sorted_ids,
    block_expert,
    topk_w,
    part,
    P,
    H,
    n_assign,
    e_loc,
    BLOCK_M,
    BR: tl.constexpr,
    BH: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    # Only the rows of the routed experts' blocks hold slots (sorted_ids past the last block is unwritten).
    e = tl.load(block_expert + rows // BLOCK_M, mask=rows < P, other=-1)
    mine = (e >= 0) & (e < e_loc)
    slot = tl.load(sorted_ids + rows, mask=mine, other=n_assign)
    routed = mine & (slot < n_assign)
    m = routed[:, None] & (cols < H)[None, :]
    w = tl.load(topk_w + slot, mask=routed, other=0.0)
    v = tl.load(y + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(part + slot.to(tl.int64)[:, None] * H + cols[None, :], v * w[:, None], mask=m)


def _offsets(block_expert, e_loc, block_m):
    """[e_loc] int32: the end row of each local expert's padded segment (virtual experts' blocks and
    unused ones, -1, counted in a spare bin)."""
    bins = torch.where((block_expert >= 0) & (block_expert < e_loc), block_expert, e_loc).long()
    blocks = torch.zeros(e_loc + 1, dtype=torch.int32, device=block_expert.device)
    blocks.scatter_add_(0, bins, torch.ones_like(block_expert))
    return (torch.cumsum(blocks[:e_loc], 0) * block_m).to(torch.int32)


def experts_grouped_mm(hidden, w13, w2, top_k, ws, *, shared_w13=None, shared_w2=None):
    """GEMMs 1 and 2 and the shared expert into ws.part[0] (the combine is the caller's, SPLIT = 1)."""
    T, H = hidden.shape
    e_loc, two_i, _ = w13.shape
    I = two_i // 2
    P, n = ws.p_max, ws.n_assign
    block_m = P // ws.nb_max
    # The rows of the routed experts' blocks gather their token (sorted_ids elsewhere: unwritten).
    e = ws.block_expert.repeat_interleave(block_m)
    slots = ws.sorted_ids.long()
    routed = (e >= 0) & (e < e_loc) & (slots < n)
    rows = hidden.index_select(0, torch.where(routed, slots // top_k, 0))
    offs = _offsets(ws.block_expert, e_loc, block_m)
    gu = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
    act = ws.act
    br, bi = 16, min(256, triton.next_power_of_2(I))
    _silu_mul_kernel[(triton.cdiv(P, br), triton.cdiv(I, bi))](
        gu, act, ws.block_expert, P, I, e_loc, block_m, BR=br, BI=bi
    )
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    bh = min(256, triton.next_power_of_2(H))
    _scatter_kernel[(triton.cdiv(P, br), triton.cdiv(H, bh))](
        y, ws.sorted_ids, ws.block_expert, ws.topk_w, ws.part, P, H, n, e_loc, block_m, BR=br, BH=bh
    )
    if shared_w13 is not None:
        # The whole shared expert into the first virtual slot (the others, if any, hold zeros):
        # two dense GEMMs, rounded where the reference rounds.
        g, u = (hidden @ shared_w13.t()).chunk(2, dim=-1)
        a = (F.silu(g.float()) * u.float()).to(hidden.dtype)
        virtual = ws.part[0, n:].view(ws.n_virt, T, H)
        virtual[0] = (a @ shared_w2.t()).float()
        virtual[1:] = 0
