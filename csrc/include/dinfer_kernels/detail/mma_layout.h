// Where the tensor-core kernels put and find their data: the shared-memory swizzle, the address
// each lane gives ldmatrix, the (row, column) each register of an mma.m16n8k16 accumulator holds,
// how a CTA's threads split a tile into 16-byte cp.async chunks, and each kernel's tile geometry.
// The CUDA kernels (attention.cu, moe.cu) compute every shared-memory offset and fragment
// coordinate through these functions, and so does the lane-level PTX emulator in tests/kernels/ptx_emu/,
// which builds the PTX semantics independently from the ISA's fragment tables: what it proves
// about these formulas holds for the code that runs. Torch- and CUDA-free; host-callable.
#pragma once

#include "dinfer_kernels/detail/attention_math.h"  // the attention tile sizes
#include "dinfer_kernels/types.h"

namespace dinfer_kernels {
namespace mma_layout {

constexpr int kChunkElems = 8;  // b16 elements per 16-byte chunk = one ldmatrix row

// ---- the swizzle ---------------------------------------------------------------------------------
// A tile is rows of `row_elems` b16 elements (>= 8 chunks, a multiple of the 128-byte bank period).
// Logical chunk c of row r is stored at chunk position c ^ (r % 8): the 8 rows an ldmatrix phase
// reads (one logical chunk of 8 consecutive rows) then hit 8 different 16-byte bank groups, and so
// do the 8 consecutive chunks of one row a cp.async phase writes.
DINFER_HD constexpr int swizzle_chunk(int row, int chunk) { return chunk ^ (row & 7); }

// Element offset of logical chunk `chunk` of row `row`.
DINFER_HD constexpr int tile_offset(int row, int chunk, int row_elems) {
  return row * row_elems + swizzle_chunk(row, chunk) * kChunkElems;
}

// ---- ldmatrix.x4 addressing ----------------------------------------------------------------------
// Lanes 8q..8q+7 give the row addresses of 8x8 matrix q; register q of every lane receives from
// matrix q. Two patterns cover every load of both kernels:
//
// "A" pattern, a 16 x 16 block stored row-major (rows = M, 16 k per row): lane l addresses row
// l % 16, chunk l / 16, so the matrices are (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7,
// k 8-15), (rows 8-15, k 8-15) = registers a0..a3 of the mma A fragment. The same addresses with
// .trans over a k-major tile (rows = k, columns = n: V of P V) give (k 0-7, n 0-7), (k 8-15,
// n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) = b0, b1 of n tile 0, then b0, b1 of n tile 1.
DINFER_HD constexpr int x4_a_row(int lane) { return lane % 16; }
DINFER_HD constexpr int x4_a_chunk(int lane) { return lane / 16; }
// "B" pattern, two n8 tiles of an n-major tile (rows = n, 16 k per row: K of Q K^T, the weight
// rows of the MoE GEMMs): lane l addresses row l % 8 of n tile l / 16, chunk (l / 8) % 2, so the
// matrices are (tile 0, k 0-7), (tile 0, k 8-15), (tile 1, k 0-7), (tile 1, k 8-15) = b0, b1 of
// tile 0, then b0, b1 of tile 1 (a non-transposed row of an n-major tile is a column of B).
DINFER_HD constexpr int x4_b_tile(int lane) { return lane / 16; }
DINFER_HD constexpr int x4_b_row(int lane) { return lane % 8; }
DINFER_HD constexpr int x4_b_chunk(int lane) { return (lane / 8) % 2; }

// ---- mma.m16n8k16 accumulators -------------------------------------------------------------------
// Register i (0..3) of a lane's fp32 C/D fragment holds C[c_row(lane, i)][c_col(lane, i)] of the
// 16 x 8 tile; registers 2j and 2j + 1 are two adjacent columns of one row.
DINFER_HD constexpr int c_row(int lane, int i) { return lane / 4 + 8 * (i / 2); }
DINFER_HD constexpr int c_col(int lane, int i) { return 2 * (lane % 4) + (i % 2); }

// ---- cp.async chunk copies -----------------------------------------------------------------------
// A CTA of `threads` threads copies a tile of rows of `chunks` 16-byte chunks; in round i thread
// tid copies chunk number tid + i * threads in row-major order: consecutive threads take
// consecutive chunks of a row (one cp.async phase writes 8 chunks of one row).
DINFER_HD constexpr int copy_row(int tid, int i, int threads, int chunks) {
  return (tid + i * threads) / chunks;
}
DINFER_HD constexpr int copy_chunk(int tid, int i, int threads, int chunks) {
  return (tid + i * threads) % chunks;
}

// ---- the attention forward kernel's tiles --------------------------------------------------------
// 4 warps; warp w owns query rows [16w, 16w + 16) of the kTileM-row Q tile; K / V tiles are kTileN
// keys; all three are swizzled tiles of rows of kD elements. Shared memory (b16 elements): the Q
// tile, then two K buffers, then two V buffers.
constexpr int kAttentionThreads = 128;

template <int kD>
struct AttentionTiles {
  static constexpr int kThreads = kAttentionThreads;
  static constexpr int kTileM = attention_math::kTileM, kTileN = attention_math::kTileN;
  static_assert(kTileM == 16 * (kThreads / 32), "one m16 slice of the query tile per warp");
  static_assert(kTileN == 64, "Q K^T covers the key tile in 4 pairs of n8 tiles, P V in 4 k16 chunks");
  static constexpr int kChunks = kD / kChunkElems;
  static constexpr int kQRounds = kTileM * kChunks / kThreads;  // cp.async rounds of the Q tile
  static constexpr int kKVRounds = kTileN * kChunks / kThreads;  // of one K (and one V) tile
  static constexpr int kKSteps = kD / 16;  // k16 steps of Q K^T (and d16 pairs of P V)
  static constexpr int kKeyChunks = kTileN / 16;  // key n8-tile pairs of Q K^T = k16 chunks of P V
  static constexpr int kDT = kD / 8;  // n8 tiles of the output per warp
  static_assert(kD % 64 == 0, "rows of >= 8 chunks and a multiple of the bank period");
  static_assert(kTileM * kChunks % kThreads == 0 && kTileN * kChunks % kThreads == 0, "whole rounds");
  static constexpr int kBufElems = kTileN * kD;  // one K or V buffer
  static constexpr int kKBase = kTileM * kD, kVBase = kKBase + 2 * kBufElems;
  static constexpr int kSmemElems = kVBase + 2 * kBufElems;

  // cp.async round i of thread tid: row and logical chunk of the tile.
  DINFER_HD static constexpr int copy_row(int tid, int i) {
    return mma_layout::copy_row(tid, i, kThreads, kChunks);
  }
  DINFER_HD static constexpr int copy_chunk(int tid, int i) {
    return mma_layout::copy_chunk(tid, i, kThreads, kChunks);
  }
  DINFER_HD static constexpr int copy_offset(int tid, int i) {
    return tile_offset(copy_row(tid, i), copy_chunk(tid, i), kD);
  }
  // Q K^T, k16 step kk: the A fragment (Q rows of the warp) ...
  DINFER_HD static constexpr int q_frag(int warp, int lane, int kk) {
    return tile_offset(16 * warp + x4_a_row(lane), 2 * kk + x4_a_chunk(lane), kD);
  }
  // ... and the B fragments of key n8 tiles 2np and 2np + 1 (registers 0-1 and 2-3).
  DINFER_HD static constexpr int k_frag(int lane, int kk, int np) {
    return tile_offset(16 * np + 8 * x4_b_tile(lane) + x4_b_row(lane), 2 * kk + x4_b_chunk(lane), kD);
  }
  // P V, 16-key chunk kc: .trans B fragments of output n8 tiles 2dp and 2dp + 1.
  DINFER_HD static constexpr int v_frag(int lane, int kc, int dp) {
    return tile_offset(16 * kc + x4_a_row(lane), 2 * dp + x4_a_chunk(lane), kD);
  }
  // P V takes the Q K^T accumulators as its A fragment (the C layout of two key n8 tiles is the A
  // layout of their 16 keys): A register j of key chunk kc packs registers p_reg(j, 0) (low half)
  // and p_reg(j, 1) of the accumulator of key n8 tile p_tile(kc, j).
  DINFER_HD static constexpr int p_tile(int kc, int j) { return 2 * kc + j / 2; }
  DINFER_HD static constexpr int p_reg(int j, int half) { return 2 * (j % 2) + half; }
  // Accumulator register i of a warp's n8 tile nt: tile row (of the kTileM) and column.
  DINFER_HD static constexpr int acc_row(int warp, int lane, int i) { return 16 * warp + c_row(lane, i); }
  DINFER_HD static constexpr int acc_col(int lane, int nt, int i) { return 8 * nt + c_col(lane, i); }
};

// ---- the MoE tensor-core GEMM tiles ----------------------------------------------------------------
// A CTA computes BM rows x BN output columns; its WM x WN warps each own WTM x WTN of it. A stage
// holds the A tile (BM rows of BK) then the weight tile: BN rows (GEMM 2), or BN gate rows then the
// BN up rows of the same columns (GEMM 1, GLU).
template <int BM, int BN, int BK, int STAGES, int WM, int WN>
struct TcConfig {
  static constexpr int kBM = BM, kBN = BN, kBK = BK, kStages = STAGES, kWM = WM, kWN = WN;
  static constexpr int kThreads = WM * WN * 32;
  static constexpr int kMinBlocks = 2;  // CTAs per SM the registers must allow (smem allows 2)
  // k16 steps unrolled per stage: all of them for the thin tiles; 2 for the 128 x 128 ones, whose
  // 64 accumulators plus prefetched fragments otherwise spill at 128 registers on sm_90.
  static constexpr int kKUnroll = BM >= 128 ? 2 : BK / 16;
};
// Small-token path: 16 rows, 4 warps side by side along N, 4 stages of 128 K (3 in flight,
// 80 KB per CTA, 2 CTAs per SM on sm_80 and sm_90): enough bytes in flight for every SM to stream
// at full rate.
using SmallGemm1 = TcConfig<16, 32, 128, 4, 1, 4>;  // 32 act columns = 64 weight rows per CTA
using SmallGemm2 = TcConfig<16, 64, 128, 4, 1, 4>;
// Large batches: 128 x 128 weight-row tiles, 8 warps (2 x 4).
using LargeGemm1 = TcConfig<128, 64, 64, 3, 2, 4>;
using LargeGemm2 = TcConfig<128, 128, 64, 3, 2, 4>;

template <class Cfg, bool GLU>
struct GemmTiles {
  static constexpr int BM = Cfg::kBM, BN = Cfg::kBN, BK = Cfg::kBK, kThreads = Cfg::kThreads;
  static constexpr int CPR = BK / kChunkElems;  // 16-byte chunks per smem row
  static constexpr int BROWS = GLU ? 2 * BN : BN;  // weight rows per tile
  static constexpr int WTM = BM / Cfg::kWM, WTN = BN / Cfg::kWN;
  static constexpr int MI = WTM / 16, NI = WTN / 8;
  static constexpr int NT = GLU ? 2 * NI : NI;  // n8 fragments per warp: gate tiles, then up tiles
  static constexpr int A_ELEMS = BM * BK, STAGE_ELEMS = (BM + BROWS) * BK;
  static constexpr int kSmemElems = Cfg::kStages * STAGE_ELEMS;  // stage s at s * STAGE_ELEMS
  static constexpr int RSTEP = kThreads / CPR;  // rows between one thread's chunks
  static constexpr int A_ITERS = BM / RSTEP, B_ITERS = BROWS / RSTEP;
  static constexpr int B_HALF = GLU ? B_ITERS / 2 : B_ITERS;  // rows per weight base
  static_assert(CPR % 8 == 0, "swizzle needs rows of >= 8 chunks");
  static_assert(kThreads % CPR == 0 && RSTEP % 8 == 0, "loader rows must keep row % 8");
  static_assert(BM % RSTEP == 0 && BROWS % RSTEP == 0, "loader must cover the tiles exactly");
  static_assert(!GLU || BN % RSTEP == 0, "a thread's rows must split evenly into gate and up");
  static_assert(WTM % 16 == 0 && WTN % 8 == 0 && NT % 2 == 0, "warp tile must be whole fragments");

  // Loader: thread tid copies logical chunk load_chunk(tid) of rows load_row(tid, i), i < ITERS;
  // its rows are RSTEP apart, a multiple of 8, so they share one swizzled chunk position.
  DINFER_HD static constexpr int load_row(int tid, int i) {
    return copy_row(tid, 0, kThreads, CPR) + i * RSTEP;
  }
  DINFER_HD static constexpr int load_chunk(int tid) { return copy_chunk(tid, 0, kThreads, CPR); }
  DINFER_HD static constexpr int load_swizzle(int tid) {
    return swizzle_chunk(load_row(tid, 0), load_chunk(tid)) * kChunkElems;
  }
  DINFER_HD static constexpr int load_offset(int tid, int i) {
    return load_row(tid, i) * BK + load_swizzle(tid);
  }

  DINFER_HD static constexpr int warp_m(int warp) { return warp / Cfg::kWN; }
  DINFER_HD static constexpr int warp_n(int warp) { return warp % Cfg::kWN; }
  // First weight row (of the stage's weight tile) of n8 fragment nt of warp column wn.
  DINFER_HD static constexpr int b_tile_row(int wn, int nt) {
    return GLU ? (nt < NI ? wn * WTN + nt * 8 : BN + wn * WTN + (nt - NI) * 8) : wn * WTN + nt * 8;
  }
  // k16 step ks: B fragments of n8 fragments 2p and 2p + 1 ...
  DINFER_HD static constexpr int b_frag(int wn, int lane, int ks, int p) {
    return tile_offset(b_tile_row(wn, 2 * p + x4_b_tile(lane)) + x4_b_row(lane), ks * 2 + x4_b_chunk(lane),
                       BK);
  }
  // ... and the A fragment of m16 slice mi of warp row wm.
  DINFER_HD static constexpr int a_frag(int wm, int lane, int ks, int mi) {
    return tile_offset(wm * WTM + mi * 16 + x4_a_row(lane), ks * 2 + x4_a_chunk(lane), BK);
  }
  // Accumulator register i of fragment (mi, j): tile row and output column (of the CTA's BN).
  DINFER_HD static constexpr int acc_row(int wm, int lane, int mi, int i) {
    return wm * WTM + mi * 16 + c_row(lane, i);
  }
  DINFER_HD static constexpr int acc_col(int wn, int lane, int j, int i) {
    return wn * WTN + j * 8 + c_col(lane, i);
  }
};

// FP8 weights (the MoE GEMMs' W8A16 path): a stage holds the A tile (b16, as GemmTiles) then the
// weight tile's e4m3 bytes, row-major [BROWS][BK] (half the bytes in flight of b16 weights); after a
// stage lands, each thread converts the 16-byte chunks it copied (16 weights, one block scale) into
// the one b16 weight tile, swizzled as GemmTiles' (so the ldmatrix / mma code is the same).
template <class Cfg, bool GLU>
struct Fp8Tiles {
  using Tiles = GemmTiles<Cfg, GLU>;
  static constexpr int BK = Cfg::kBK, BN = Cfg::kBN, kThreads = Cfg::kThreads;
  static constexpr int kChunk = 16;  // e4m3 weights per 16-byte chunk
  static constexpr int CPR = BK / kChunk;  // chunks per staged row
  static constexpr int RSTEP = kThreads / CPR;  // rows between one thread's chunks
  static constexpr int B_ITERS = Tiles::BROWS / RSTEP;
  static constexpr int B_HALF = GLU ? B_ITERS / 2 : B_ITERS;  // rows per weight base
  static constexpr int B8_ELEMS = Tiles::BROWS * BK / 2;  // the staged bytes, counted in b16 elements
  static constexpr int STAGE_ELEMS = Tiles::A_ELEMS + B8_ELEMS;  // stage s at s * STAGE_ELEMS
  static constexpr int CONV_AT = Cfg::kStages * STAGE_ELEMS;  // the converted b16 weight tile
  static constexpr int kSmemElems = CONV_AT + Tiles::BROWS * BK;
  static_assert(kThreads % CPR == 0 && Tiles::BROWS % RSTEP == 0, "loader must cover the tile exactly");
  static_assert(!GLU || BN % RSTEP == 0, "a thread's rows must split evenly into gate and up");
  static_assert(128 % BK == 0, "a k tile lies in one 128-column scale block");

  // Round i of thread tid: staged row (gate rows, then up rows) and chunk ...
  DINFER_HD static constexpr int load_row(int tid, int i) { return tid / CPR + i * RSTEP; }
  DINFER_HD static constexpr int load_chunk(int tid) { return tid % CPR; }
  // ... the byte offset of the chunk in the stage's weight bytes, the output column (of the CTA's BN:
  // the weight row within its half) it belongs to ...
  DINFER_HD static constexpr int staged_offset(int tid, int i) {
    return load_row(tid, i) * BK + load_chunk(tid) * kChunk;
  }
  DINFER_HD static constexpr int out_col(int tid, int i) { return load_row(tid, i % B_HALF); }
  // ... and where its weights 8h .. 8h + 7 (h = 0, 1) go in the b16 tile: logical chunks 2c, 2c + 1.
  DINFER_HD static constexpr int conv_offset(int tid, int i, int h) {
    return tile_offset(load_row(tid, i), 2 * load_chunk(tid) + h, BK);
  }
};

}  // namespace mma_layout
}  // namespace dinfer_kernels
