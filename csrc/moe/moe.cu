// CUDA backend of the fused MoE layer. Contract: dinfer_kernels/reference/moe.py.
//
// One memset of a few counters and four launches, no host synchronisation and no allocation, all
// grid sizes functions of the shapes only (CUDA-graph capturable):
//
//   1. route_kernel, grid (token tiles) x (expert chunks of 16). Each CTA computes the fp32 router
//      logits of its tokens x experts (or takes the given logits). The last CTA of a token tile to
//      finish (an integer counter per tile) scores the tile's tokens (softmax or sigmoid + bias,
//      grouped top-k) and writes each token's top-k (expert, weight) sorted by expert id (a given
//      top-k: its slots sorted so, grid (token tiles) x 1). The last token tile to finish aligns:
//      per-expert counts, tile offsets, and the permuted entry list (entry = token * top_k + slot),
//      each local expert's rows padded to a multiple of BLOCK_M, in token order (deterministic), plus
//      the local expert (index into w13 / w2, which hold the local experts only) of every M tile and
//      the number of tiles; entries of other experts are dropped here. All but the logits is
//      moe_route.h, which the tests also run lane by lane on the host.
//   2. GEMM 1 (gate/up + SiLU): grid (max M tiles) x (N tiles over I). A CTA gathers its tile's
//      hidden rows, streams the gate rows and the up rows of the same output columns of its expert
//      through a cp.async pipeline, multiplies on the tensor cores (mma.sync m16n8k16, fp32
//      accumulation) and writes act = dtype(silu(g) * u) rows. CTAs past the real tile count exit.
//   3. GEMM 2 (down): same structure over w2; the epilogue multiplies by the routing weight and
//      writes one fp32 row per (token, slot) entry.
//   4. combine_kernel: out[t] = sum of the token's local slots in increasing expert order (the
//      reference's order), in fp32, rounded once to the output dtype. No float atomics anywhere,
//      so two runs are bit-identical.
//
// The shared expert (S > 0) runs as ceil(S / I) virtual experts after the local ones
// (moe_experts.h): every token is one more entry of each (T top_k + j T + t, weight 1), their weights
// read in place (gate rows j I.., up rows S + j I.., w2 columns j I.. with row stride S; the last one
// narrower, its act columns past the slice zero), summed after the routed slots in the combine.
//
// FP8 weights (e4m3 with 128 x 128 block scales): the GEMMs cp.async the weight bytes (half the bytes
// in flight of bf16), and after a stage lands each thread dequantises the chunks it copied (fp32(q) *
// scale, rounded to the dtype: the contract's rounding) into one b16 weight tile; the ldmatrix / mma
// code is the same (mma_layout::Fp8Tiles). An FP8 call equals the call on the dequantised weights.
//
// Two tensor-core configurations: a small-token one (BLOCK_M 16, 4 warps side by side along N,
// deep K pipeline: the weights stream at full rate when experts get ~8-16 rows) and a large one
// (128 x 128 tiles, 8 warps) for prefill-sized batches. fp32 activations, or H / I / S not multiples of
// 8 (16 with FP8 weights), take a plain SIMT GEMM with the same tiling of rows (correct, not fast).
//
// The mma.m16n8k16 fragment layouts, the ldmatrix addressing, the shared-memory swizzle and the
// tile geometry are in dinfer_kernels/detail/mma_layout.h; the PTX wrappers in common/ptx.cuh.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/ptx.cuh"
#include "common/workspace.h"
#include "dinfer_kernels/detail/dtype_tags.h"
#include "dinfer_kernels/detail/mma_layout.h"
#include "dinfer_kernels/detail/moe_experts.h"
#include "dinfer_kernels/detail/moe_math.h"
#include "dinfer_kernels/detail/moe_route.h"
#include "dinfer_kernels/moe.h"

namespace dinfer_kernels {
namespace {

using dtype::BF16Tag;
using dtype::F16Tag;
using dtype::F32Tag;
using dtype::from_float;
using dtype::round_to;
using dtype::to_float;
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::mma_16816;
using workspace::align_up;
using workspace::aligned16;

// Four consecutive elements at a 4-element-aligned index (16 bytes for fp32, 8 for 16-bit types).
__device__ __forceinline__ void load4_any(const void* p, ScalarType t, int64_t i, float (&v)[4]) {
  if (t == ScalarType::kFloat32) {
    const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
    return;
  }
  const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(p) + i);
  const uint16_t h[4] = {static_cast<uint16_t>(q.x & 0xFFFFu), static_cast<uint16_t>(q.x >> 16),
                         static_cast<uint16_t>(q.y & 0xFFFFu), static_cast<uint16_t>(q.y >> 16)};
  DINFER_UNROLL
  for (int j = 0; j < 4; ++j)
    v[j] = t == ScalarType::kBFloat16 ? moe_math::bf16_to_float(h[j]) : moe_math::fp16_to_float(h[j]);
}

// =================================================================================================
// 1. Routing and alignment (after the router logits: moe_route.h)
// =================================================================================================

using namespace moe_route;

// Router logits of TT tokens x 2 experts for this warp, fp32 with fp32 accumulation.
template <int TT>
__device__ __forceinline__ void router_logits_warp(const RouteArgs& a, int t0, int e_first, int lane) {
  float acc[kRouteExpertsPerWarp][TT];
  DINFER_UNROLL
  for (int x = 0; x < kRouteExpertsPerWarp; ++x) {
    DINFER_UNROLL
    for (int tt = 0; tt < TT; ++tt) acc[x][tt] = 0.f;
  }
  const int64_t H = a.H;
  // Rows past the end read row 0 (valid memory) and are never written back.
  int64_t wrow[kRouteExpertsPerWarp], xrow[TT];
  DINFER_UNROLL
  for (int x = 0; x < kRouteExpertsPerWarp; ++x) wrow[x] = (e_first + x < a.E ? e_first + x : 0) * H;
  DINFER_UNROLL
  for (int tt = 0; tt < TT; ++tt) xrow[tt] = (t0 + tt < a.T ? t0 + tt : 0) * H;

  if (a.vec4) {
    for (int64_t h = lane * 4; h < H; h += 128) {
      float w[kRouteExpertsPerWarp][4];
      DINFER_UNROLL
      for (int x = 0; x < kRouteExpertsPerWarp; ++x)
        load4_any(a.router_weight, a.router_dtype, wrow[x] + h, w[x]);
      DINFER_UNROLL
      for (int tt = 0; tt < TT; ++tt) {
        float v[4];
        load4_any(a.hidden, a.hidden_dtype, xrow[tt] + h, v);
        DINFER_UNROLL
        for (int x = 0; x < kRouteExpertsPerWarp; ++x) {
          DINFER_UNROLL
          for (int j = 0; j < 4; ++j) acc[x][tt] = fmaf(v[j], w[x][j], acc[x][tt]);
        }
      }
    }
  } else {
    for (int64_t h = lane; h < H; h += 32) {
      float w[kRouteExpertsPerWarp];
      DINFER_UNROLL
      for (int x = 0; x < kRouteExpertsPerWarp; ++x)
        w[x] = dtype::load_float(a.router_weight, a.router_dtype, wrow[x] + h);
      DINFER_UNROLL
      for (int tt = 0; tt < TT; ++tt) {
        const float v = dtype::load_float(a.hidden, a.hidden_dtype, xrow[tt] + h);
        DINFER_UNROLL
        for (int x = 0; x < kRouteExpertsPerWarp; ++x) acc[x][tt] = fmaf(v, w[x], acc[x][tt]);
      }
    }
  }
  DINFER_UNROLL
  for (int x = 0; x < kRouteExpertsPerWarp; ++x) {
    DINFER_UNROLL
    for (int tt = 0; tt < TT; ++tt) {
      const float s = simt::warp_sum(acc[x][tt]);
      if (lane == 0 && e_first + x < a.E && t0 + tt < a.T)
        a.logits[static_cast<int64_t>(t0 + tt) * a.E + e_first + x] = s;
    }
  }
}

template <int TT>
__global__ void __launch_bounds__(kRouteThreads) route_kernel(const __grid_constant__ RouteArgs a) {
  __shared__ RouteShared sh;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile = blockIdx.x;

  if (a.router_weight != nullptr) {
    router_logits_warp<TT>(a, tile * TT, blockIdx.y * kRouteExpertsPerCta + warp * kRouteExpertsPerWarp,
                           lane);
    // Last CTA of this token tile to finish scores it (classic threadfence + counter pattern).
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) sh.is_last = atomicAdd(a.tile_counter + tile, 1) == static_cast<int>(gridDim.y) - 1;
    __syncthreads();
    if (!sh.is_last) return;
    __threadfence();
  }
  moe_route::score_and_align<TT>(a, sh, tile, static_cast<int>(gridDim.x), warp, lane);
}

// =================================================================================================
// 2-3. Grouped GEMMs
// =================================================================================================

struct GemmArgs {
  const void* a_src;  // GEMM 1: hidden [T, K]; GEMM 2: act [rows, K]
  const void* w;  // GEMM 1: w13 [E, 2N, K]; GEMM 2: w2 [E, N, K]
  const void* w_shared;  // GEMM 1: shared_w13 [2S, K]; GEMM 2: shared_w2 [N, S] (null: no shared expert)
  const float* scale;  // FP8 weights: the block scales of w and w_shared (null: not FP8)
  const float* scale_shared;
  void* act;  // GEMM 1 output [rows, N] in the dtype
  float* ypart;  // GEMM 2 output [entries, N] fp32
  const int32_t* sorted_ids;  // [rows]
  const int32_t* tile_expert;  // [max_tiles]
  const int32_t* num_tiles;  // [1]
  const float* topk_w;  // [T * top_k]
  int32_t K, N, top_k, bm;
  int32_t T, local_experts, H, I, S;  // the experts' list and their slices (moe_experts.h)
};

// The slice of expert `expert` a GEMM reads and its bounds: GEMM 1 computes the slice's `width`
// intermediate columns (N = I, the rest of an act row stays zero) over K = H; GEMM 2 the N = H outputs
// over the slice's width columns of W2 (row stride down_ld), K = I (act's zero columns past it).
struct GemmSlice {
  moe_experts::ExpertSlice x;
  int32_t n_limit, k_limit;  // valid weight rows (output columns) and columns
  int64_t ld;  // weight row stride, in elements
  int64_t at0, at1;  // element offset of weight row 0: gate / down, and up (GEMM 1)
};

template <bool GLU>
__device__ __forceinline__ GemmSlice gemm_slice(const GemmArgs& a, int expert) {
  GemmSlice g;
  g.x = moe_experts::expert_slice(expert, a.local_experts, a.H, a.I, a.S);
  g.n_limit = GLU ? static_cast<int32_t>(g.x.width) : a.N;
  g.k_limit = GLU ? a.K : static_cast<int32_t>(g.x.width);
  g.ld = GLU ? a.K : g.x.down_ld;
  g.at0 = GLU ? g.x.gate_at : g.x.down_at;
  g.at1 = GLU ? g.x.up_at : 0;
  return g;
}

// The block scale of weight row n (a GEMM 1 output column of the gate or up half, or a GEMM 2 output
// row), column k.
template <bool GLU>
__device__ __forceinline__ float block_scale(const GemmArgs& a, const GemmSlice& g, bool up, int n, int k) {
  const float* s = g.x.shared ? a.scale_shared : a.scale;
  return s[GLU ? moe_experts::w13_scale_index(g.x, up, n, k, a.K) : moe_experts::w2_scale_index(g.x, n, k)];
}

// The token whose hidden row entry `entry` multiplies (-1: a padding row), and the entry's weight.
__device__ __forceinline__ int32_t entry_token(const GemmArgs& a, int32_t entry) {
  return entry >= 0 ? static_cast<int32_t>(moe_experts::entry_token(entry, a.T, a.top_k)) : -1;
}
__device__ __forceinline__ float entry_weight(const GemmArgs& a, int32_t entry) {
  return entry < static_cast<int64_t>(a.T) * a.top_k ? a.topk_w[entry] : 1.f;  // the shared expert: 1
}

// The tile configurations and every shared-memory offset and fragment coordinate of the
// tensor-core GEMM: mma_layout::TcConfig / GemmTiles / Fp8Tiles (tested lane by lane on the host).
using mma_layout::LargeGemm1;
using mma_layout::LargeGemm2;
using mma_layout::SmallGemm1;
using mma_layout::SmallGemm2;

template <class Cfg, bool GLU, bool FP8>
constexpr int tc_smem_bytes() {
  return (FP8 ? mma_layout::Fp8Tiles<Cfg, GLU>::kSmemElems : mma_layout::GemmTiles<Cfg, GLU>::kSmemElems) * 2;
}

// FP8: the 16 e4m3 weights of one staged chunk, times their block scale, rounded to the dtype, as
// two 8-element b16 chunks of the converted tile.
template <class Tag>
__device__ __forceinline__ void convert_chunk(const uint8_t* src, float scale, uint16_t* dst0,
                                              uint16_t* dst1) {
  DINFER_UNROLL
  for (int h = 0; h < 2; ++h) {  // 8 weights at a time: fewer live registers beside the accumulators
    const uint2 raw = *reinterpret_cast<const uint2*>(src + 8 * h);
    uint32_t out[4];
    DINFER_UNROLL
    for (int j = 0; j < 4; ++j) {
      const uint32_t w = (j < 2 ? raw.x : raw.y) >> (16 * (j % 2));
      out[j] = ptx::pack2(moe_experts::fp8_dequant(static_cast<uint8_t>(w & 0xFFu), scale),
                          moe_experts::fp8_dequant(static_cast<uint8_t>((w >> 8) & 0xFFu), scale), Tag{});
    }
    *reinterpret_cast<uint4*>(h == 0 ? dst0 : dst1) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

template <class Tag, class Cfg, bool GLU, bool FP8>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    gemm_tc_kernel(const __grid_constant__ GemmArgs a) {
  using T = mma_layout::GemmTiles<Cfg, GLU>;
  using T8 = mma_layout::Fp8Tiles<Cfg, GLU>;
  constexpr int BM = Cfg::kBM, BN = Cfg::kBN, BK = Cfg::kBK, STAGES = Cfg::kStages;
  constexpr int NI = T::NI, NT = T::NT, MI = T::MI;
  constexpr int A_ELEMS = T::A_ELEMS, STAGE_ELEMS = FP8 ? T8::STAGE_ELEMS : T::STAGE_ELEMS;
  constexpr int RSTEP = T::RSTEP, A_ITERS = T::A_ITERS, B_ITERS = T::B_ITERS, B_HALF = T::B_HALF;

  const int tile = blockIdx.x;
  if (tile >= *a.num_tiles) return;  // uniform per CTA: grid sized for the worst case
  const GemmSlice g = gemm_slice<GLU>(a, a.tile_expert[tile]);
  const int n0 = blockIdx.y * BN;
  const int K = a.K;

  extern __shared__ uint4 smem_u4[];
  uint16_t* smem = reinterpret_cast<uint16_t*>(smem_u4);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = T::warp_m(warp), wn = T::warp_n(warp);

  // Loader: this thread copies chunk column lc of rows lr0 + i * RSTEP (T::load_offset; FP8 weights:
  // T8's rows and chunks). Weight rows i of a tile are consecutive from one base (GEMM 2), or from two
  // (the gate half and the up half of GEMM 1): base + (i % half) * RSTEP rows, valid while the row
  // is below n_limit and the column below k_limit.
  const int lc = T::load_chunk(tid), lr0 = T::load_row(tid, 0);
  const uint16_t* src_a = static_cast<const uint16_t*>(a.a_src);
  const char* src_w = static_cast<const char*>(g.x.shared ? a.w_shared : a.w);
  constexpr int WBYTES = FP8 ? 1 : 2;
  const int n_first = n0 + (FP8 ? T8::out_col(tid, 0) : lr0);  // output column of the first weight row
  const char* b_base0 = src_w + (g.at0 + n_first * g.ld) * WBYTES;  // gate / down
  const char* b_base1 = src_w + (g.at1 + n_first * g.ld) * WBYTES;  // up (GEMM 1)
  // GEMM 1 gathers hidden rows by token (-1: padding row, zero-filled); GEMM 2 reads act rows,
  // consecutive from the tile's first (their padding rows hold zeros written by GEMM 1).
  int32_t a_tok[GLU ? A_ITERS : 1];
  const uint16_t* a_base = src_a + (static_cast<int64_t>(tile) * BM + lr0) * K;
  if (GLU) {
    DINFER_UNROLL
    for (int i = 0; i < A_ITERS; ++i)
      a_tok[i] = entry_token(a, a.sorted_ids[static_cast<int64_t>(tile) * BM + lr0 + i * RSTEP]);
  }

  const int ktiles = (K + BK - 1) / BK;
  auto load_stage = [&](int stage, int kt) {
    const int k = kt * BK + lc * 8;
    const bool kin = k < K;  // K % 8 == 0: a chunk is wholly inside or outside
    uint16_t* s = smem + stage * STAGE_ELEMS;
    DINFER_UNROLL
    for (int i = 0; i < A_ITERS; ++i) {
      const bool ok = kin && (!GLU || a_tok[GLU ? i : 0] >= 0);
      const uint16_t* src = GLU ? src_a + static_cast<int64_t>(a_tok[GLU ? i : 0]) * K + k
                                : a_base + static_cast<int64_t>(i * RSTEP) * K + k;
      cp_async16(s + T::load_offset(tid, i), ok ? src : src_a, ok);
    }
    if constexpr (FP8) {
      const int k8 = kt * BK + T8::load_chunk(tid) * T8::kChunk;
      char* s8 = reinterpret_cast<char*>(s + A_ELEMS);
      DINFER_UNROLL
      for (int i = 0; i < T8::B_ITERS; ++i) {
        const int ii = i % T8::B_HALF;
        const bool ok = k8 < g.k_limit && n_first + ii * T8::RSTEP < g.n_limit;  // whole 16-weight chunks
        const char* src = (i < T8::B_HALF ? b_base0 : b_base1) + ii * T8::RSTEP * g.ld + k8;
        cp_async16(s8 + T8::staged_offset(tid, i), ok ? src : src_w, ok);
      }
    } else {
      DINFER_UNROLL
      for (int i = 0; i < B_ITERS; ++i) {
        const int ii = i % B_HALF;
        const bool ok = k < g.k_limit && n_first + ii * RSTEP < g.n_limit;
        const char* src = (i < B_HALF ? b_base0 : b_base1) + (ii * RSTEP * g.ld + k) * 2;
        cp_async16(s + A_ELEMS + T::load_offset(tid, i), ok ? src : src_w, ok);
      }
    }
  };
  // FP8: the chunks this thread copied into stage `stage` (k tile kt), dequantised into the b16 tile.
  // Its own copies only: visible to it after cp.async.wait_group, no barrier needed before. The scale
  // of a chunk: its row's part (s_row, -1 for a row past the slice, zero-filled) plus the column block
  // of the expert's column s_col + k (GEMM 2 slices start at column `first` of the shared expert).
  const float* scales = g.x.shared ? a.scale_shared : a.scale;
  int32_t s_row[FP8 ? T8::B_ITERS : 1];
  const int s_col = GLU ? 0 : static_cast<int>(g.x.first);
  if constexpr (FP8) {
    DINFER_UNROLL
    for (int i = 0; i < T8::B_ITERS; ++i) {
      const int n = n0 + T8::out_col(tid, i);
      s_row[i] = n >= g.n_limit ? -1
                 : GLU          ? static_cast<int32_t>(moe_experts::w13_scale_row(g.x, i >= T8::B_HALF, n, K))
                                : static_cast<int32_t>(moe_experts::w2_scale_row(g.x, n));
    }
  }
  auto convert_stage = [&](int stage, int kt) {
    const uint8_t* s8 = reinterpret_cast<const uint8_t*>(smem + stage * STAGE_ELEMS + A_ELEMS);
    uint16_t* conv = smem + T8::CONV_AT;
    const int k8 = kt * BK + T8::load_chunk(tid) * T8::kChunk;
    const int col_block = (s_col + k8) / static_cast<int>(kMoeFp8Block);
    DINFER_UNROLL
    for (int i = 0; i < T8::B_ITERS; ++i) {
      // Rows and columns past the slice were zero-filled: a zero scale keeps them zero.
      const float scale =
          k8 < g.k_limit && s_row[FP8 ? i : 0] >= 0 ? scales[s_row[FP8 ? i : 0] + col_block] : 0.f;
      convert_chunk<Tag>(s8 + T8::staged_offset(tid, i), scale, conv + T8::conv_offset(tid, i, 0),
                         conv + T8::conv_offset(tid, i, 1));
    }
  };

  float acc[MI][NT][4];
  DINFER_UNROLL
  for (int mi = 0; mi < MI; ++mi) {
    DINFER_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
      DINFER_UNROLL
      for (int c = 0; c < 4; ++c) acc[mi][nt][c] = 0.f;
    }
  }

  DINFER_UNROLL
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();  // always commit: group counting stays uniform
  }

  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile kt landed for every thread; stage (kt - 1) % STAGES (and FP8's converted
    // tile) is free again
    if constexpr (FP8) convert_stage(kt % STAGES, kt);
    if (kt + STAGES - 1 < ktiles) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
    cp_async_commit();
    if constexpr (FP8) __syncthreads();  // the converted weight tile is complete

    const uint16_t* sa = smem + (kt % STAGES) * STAGE_ELEMS;
    const uint16_t* sb = FP8 ? smem + T8::CONV_AT : sa + A_ELEMS;
#if defined(__CUDA_ARCH__)
    constexpr int KUNROLL = Cfg::kKUnroll;
#pragma unroll KUNROLL
#endif
    for (int ks = 0; ks < BK / 16; ++ks) {
      uint32_t bf[NT][2];
      DINFER_UNROLL
      for (int p = 0; p < NT / 2; ++p) {
        uint32_t r[4];
        ldmatrix_x4(r, sb + T::b_frag(wn, lane, ks, p));
        bf[2 * p][0] = r[0];
        bf[2 * p][1] = r[1];
        bf[2 * p + 1][0] = r[2];
        bf[2 * p + 1][1] = r[3];
      }
      DINFER_UNROLL
      for (int mi = 0; mi < MI; ++mi) {
        uint32_t af[4];
        ldmatrix_x4(af, sa + T::a_frag(wm, lane, ks, mi));
        DINFER_UNROLL
        for (int nt = 0; nt < NT; ++nt) mma_16816(acc[mi][nt], af, bf[nt][0], bf[nt][1], Tag{});
      }
    }
  }
  cp_async_wait<0>();  // nothing may be in flight when the CTA exits

  // Epilogue. Registers 2 half and 2 half + 1 of fragment (mi, j) are two adjacent columns of
  // one row (T::acc_row / acc_col).
  const int N = a.N;
  DINFER_UNROLL
  for (int mi = 0; mi < MI; ++mi) {
    DINFER_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int r = T::acc_row(wm, lane, mi, 2 * half);
      const int64_t row = static_cast<int64_t>(tile) * BM + r;
      if (GLU) {
        uint16_t* act = static_cast<uint16_t*>(a.act);
        DINFER_UNROLL
        for (int j = 0; j < NI; ++j) {
          const int col = n0 + T::acc_col(wn, lane, j, 2 * half);
          if (col >= N) continue;  // N % 8 == 0: the pair is wholly inside or outside
          const float* gv = acc[mi][j] + half * 2;
          const float* uv = acc[mi][NI + j] + half * 2;
          const uint32_t lo =
              from_float(moe_math::silu_mul(round_to<Tag>(gv[0]), round_to<Tag>(uv[0])), Tag{});
          const uint32_t hi =
              from_float(moe_math::silu_mul(round_to<Tag>(gv[1]), round_to<Tag>(uv[1])), Tag{});
          *reinterpret_cast<uint32_t*>(act + row * N + col) = lo | (hi << 16);
        }
      } else {
        const int32_t entry = a.sorted_ids[row];
        if (entry < 0) continue;
        const float w = entry_weight(a, entry);
        DINFER_UNROLL
        for (int j = 0; j < NI; ++j) {
          const int col = n0 + T::acc_col(wn, lane, j, 2 * half);
          if (col >= N) continue;
          const float* cv = acc[mi][j] + half * 2;
          *reinterpret_cast<float2*>(a.ypart + static_cast<int64_t>(entry) * N + col) =
              make_float2(round_to<Tag>(cv[0]) * w, round_to<Tag>(cv[1]) * w);
        }
      }
    }
  }
}

// Fallback for fp32 activations or sizes the tensor-core tiles cannot take: one CTA per 16 rows x 64
// columns, fp32 FMAs from shared memory. Same row tiling, same rounding points as the tensor-core
// kernel (FP8 weights dequantised on load, a.scale set).
constexpr int kSimtThreads = 256, kSimtRows = 16, kSimtCols = 64, kSimtK = 32;

template <class Tag, bool GLU>
__global__ void __launch_bounds__(kSimtThreads) gemm_simt_kernel(const __grid_constant__ GemmArgs a) {
  using Raw = typename Tag::Raw;
  constexpr int BROWS = GLU ? 2 * kSimtCols : kSimtCols;
  __shared__ float sa[kSimtRows][kSimtK + 1];
  __shared__ float sb[BROWS][kSimtK + 1];
  const int sub_per_tile = a.bm / kSimtRows;
  const int tile = blockIdx.x / sub_per_tile;
  if (tile >= *a.num_tiles) return;
  const GemmSlice g = gemm_slice<GLU>(a, a.tile_expert[tile]);
  const int64_t row0 = static_cast<int64_t>(tile) * a.bm + (blockIdx.x % sub_per_tile) * kSimtRows;
  const int n0 = blockIdx.y * kSimtCols;
  const int K = a.K, N = a.N, tid = threadIdx.x;
  const Raw* src_a = static_cast<const Raw*>(a.a_src);
  const void* src_w = g.x.shared ? a.w_shared : a.w;
  const bool fp8 = a.scale != nullptr;

  const int r = tid / 16, c0 = tid % 16;  // rows r, columns c0 + 16 j
  float accg[4] = {0.f, 0.f, 0.f, 0.f}, accu[4] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < K; k0 += kSimtK) {
    for (int i = tid; i < kSimtRows * kSimtK; i += kSimtThreads) {
      const int rr = i / kSimtK, kk = i % kSimtK, k = k0 + kk;
      float v = 0.f;
      if (k < K) {
        if (GLU) {
          const int32_t token = entry_token(a, a.sorted_ids[row0 + rr]);
          if (token >= 0) v = to_float(src_a[static_cast<int64_t>(token) * K + k], Tag{});
        } else {
          v = to_float(src_a[(row0 + rr) * K + k], Tag{});
        }
      }
      sa[rr][kk] = v;
    }
    for (int i = tid; i < BROWS * kSimtK; i += kSimtThreads) {
      const int j = i / kSimtK, kk = i % kSimtK, k = k0 + kk;
      const bool up = GLU && j >= kSimtCols;
      const int n = n0 + (GLU ? j % kSimtCols : j);
      float v = 0.f;
      if (k < g.k_limit && n < g.n_limit) {
        const int64_t at = (up ? g.at1 : g.at0) + n * g.ld + k;
        v = fp8 ? round_to<Tag>(moe_experts::fp8_dequant(static_cast<const uint8_t*>(src_w)[at],
                                                         block_scale<GLU>(a, g, up, n, k)))
                : to_float(static_cast<const Raw*>(src_w)[at], Tag{});
      }
      sb[j][kk] = v;
    }
    __syncthreads();
    for (int kk = 0; kk < kSimtK; ++kk) {
      const float x = sa[r][kk];
      DINFER_UNROLL
      for (int j = 0; j < 4; ++j) {
        accg[j] = fmaf(x, sb[c0 + 16 * j][kk], accg[j]);
        if (GLU) accu[j] = fmaf(x, sb[kSimtCols + c0 + 16 * j][kk], accu[j]);
      }
    }
    __syncthreads();
  }
  const int64_t row = row0 + r;
  if (GLU) {
    Raw* act = static_cast<Raw*>(a.act);
    DINFER_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int col = n0 + c0 + 16 * j;
      if (col < N)
        act[row * N + col] =
            from_float(moe_math::silu_mul(round_to<Tag>(accg[j]), round_to<Tag>(accu[j])), Tag{});
    }
  } else {
    const int32_t entry = a.sorted_ids[row];
    if (entry < 0) return;
    const float w = entry_weight(a, entry);
    DINFER_UNROLL
    for (int j = 0; j < 4; ++j) {
      const int col = n0 + c0 + 16 * j;
      if (col < N) a.ypart[static_cast<int64_t>(entry) * N + col] = round_to<Tag>(accg[j]) * w;
    }
  }
}

// =================================================================================================
// 4. Combine
// =================================================================================================

constexpr int kCombineThreads = 256;
constexpr int kCombineCols = kCombineThreads * 4;

struct CombineArgs {
  const float* ypart;  // [entries, H]
  const int32_t* topk_ids;  // [T, top_k], increasing per token
  void* out;  // [T, H]
  int32_t T, H, top_k, e0, e1;
  int32_t shared_experts;  // the shared expert's virtual experts: their entries follow the routed ones
  bool vec4;  // H % 4 == 0
};

// acc += the 4 (or fewer, at the end of a row) fp32 values of y.
__device__ __forceinline__ void add4(const float* y, bool vec4, int h, int H, float (&acc)[4]) {
  if (vec4) {
    const float4 q = *reinterpret_cast<const float4*>(y);
    acc[0] += q.x;
    acc[1] += q.y;
    acc[2] += q.z;
    acc[3] += q.w;
  } else {
    DINFER_UNROLL
    for (int c = 0; c < 4; ++c)
      if (h + c < H) acc[c] += y[c];
  }
}

template <class Tag>
__device__ __forceinline__ void store_out(void* out, int64_t i, float v) {
  static_cast<typename Tag::Raw*>(out)[i] = from_float(v, Tag{});
}

template <class Tag>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const __grid_constant__ CombineArgs a) {
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y * kCombineCols + threadIdx.x * 4;
  if (h >= a.H) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < a.top_k; ++j) {
    const int64_t entry = t * a.top_k + j;
    const int32_t id = a.topk_ids[entry];
    if (id < a.e0 || id >= a.e1) continue;
    add4(a.ypart + entry * a.H + h, a.vec4, h, a.H, acc);
  }
  // The shared expert after the routed sum (as the reference adds it), its virtual experts in order.
  for (int j = 0; j < a.shared_experts; ++j)
    add4(a.ypart + moe_experts::virtual_entry(t, j, a.T, a.top_k) * a.H + h, a.vec4, h, a.H, acc);
  DINFER_UNROLL
  for (int c = 0; c < 4; ++c)
    if (h + c < a.H) store_out<Tag>(a.out, t * a.H + h + c, acc[c]);
}

// =================================================================================================
// Host side
// =================================================================================================

// Everything below is a pure function of (T, E, top_k, H, I): the launch shapes never depend on
// the data or on the GPU model.
struct Plan {
  bool large;  // the 128-row tensor-core configuration
  int bm;  // rows per M tile
  int route_tt;  // tokens per routing CTA
  int64_t token_tiles;
  int64_t max_tiles;  // upper bound of the number of M tiles over any routing
  size_t counters, logits, topk_ids, topk_w, sorted_ids, tile_expert, num_tiles, act, ypart, total;
  size_t counters_bytes;
};

// E: the router's experts (0 with a given top-k: no logits); El: the local ones; S: the shared
// expert's intermediate size (0: none), run as num_virtual(S, I) more experts of every token.
Plan make_plan(int64_t T, int64_t E, int64_t El, int64_t top_k, int64_t H, int64_t I, int64_t S) {
  Plan p;
  const int64_t nv = moe_experts::num_virtual(S, I);
  const int64_t routed = T * top_k, entries = moe_experts::num_entries(T, top_k, nv);
  // ~48 rows per expert and up: the 128-row tiles waste less than the 16-row ones re-read weights.
  const int64_t experts = E > 0 ? E : El;  // a given top-k: its rows are those of the local experts
  p.large = experts > 0 && routed >= 48 * experts;
  p.bm = p.large ? LargeGemm1::kBM : SmallGemm1::kBM;
  p.route_tt = moe_route::tokens_per_cta(T);
  p.token_tiles = (T + p.route_tt - 1) / p.route_tt;
  // sum over experts of ceil(c_e / bm) <= (entries + nonempty * (bm - 1)) / bm.
  const int64_t nonempty = El + nv < entries ? El + nv : entries;
  p.max_tiles = (entries + nonempty * (p.bm - 1)) / p.bm;
  const int64_t rows = p.max_tiles * p.bm;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes);
    return at;
  };
  p.counters_bytes = static_cast<size_t>(p.token_tiles + 1) * sizeof(int32_t);
  p.counters = take(p.counters_bytes);
  p.logits = take(static_cast<size_t>(T * E) * sizeof(float));
  p.topk_ids = take(static_cast<size_t>(routed) * sizeof(int32_t));
  p.topk_w = take(static_cast<size_t>(routed) * sizeof(float));
  p.sorted_ids = take(static_cast<size_t>(rows) * sizeof(int32_t));
  p.tile_expert = take(static_cast<size_t>(p.max_tiles) * sizeof(int32_t));
  p.num_tiles = take(sizeof(int32_t));
  p.act = take(static_cast<size_t>(rows) * static_cast<size_t>(I) * sizeof(float));  // fp32 worst case
  p.ypart = take(static_cast<size_t>(entries) * static_cast<size_t>(H) * sizeof(float));
  p.total = off;
  return p;
}

template <class Tag, class Cfg, bool GLU, bool FP8>
cudaError_t launch_tc(const GemmArgs& g, int64_t max_tiles, cudaStream_t stream) {
  constexpr int smem = tc_smem_bytes<Cfg, GLU, FP8>();
  auto kernel = gemm_tc_kernel<Tag, Cfg, GLU, FP8>;
  // Every launch (cheap): the attribute is per device, and this call is legal during graph capture.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(max_tiles), static_cast<unsigned>((g.N + Cfg::kBN - 1) / Cfg::kBN));
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(g);
  return cudaGetLastError();
}

template <class Tag, bool GLU>
cudaError_t launch_simt(const GemmArgs& g, int64_t max_tiles, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(max_tiles * (g.bm / kSimtRows)),
                  static_cast<unsigned>((g.N + kSimtCols - 1) / kSimtCols));
  gemm_simt_kernel<Tag, GLU><<<grid, kSimtThreads, 0, stream>>>(g);
  return cudaGetLastError();
}

template <class Tag, bool FP8>
cudaError_t launch_tc_gemms(const GemmArgs& g1, const GemmArgs& g2, const Plan& plan, cudaStream_t stream) {
  cudaError_t err;
  if (plan.large) {
    err = launch_tc<Tag, LargeGemm1, true, FP8>(g1, plan.max_tiles, stream);
    if (err != cudaSuccess) return err;
    return launch_tc<Tag, LargeGemm2, false, FP8>(g2, plan.max_tiles, stream);
  }
  err = launch_tc<Tag, SmallGemm1, true, FP8>(g1, plan.max_tiles, stream);
  if (err != cudaSuccess) return err;
  return launch_tc<Tag, SmallGemm2, false, FP8>(g2, plan.max_tiles, stream);
}

template <class Tag>
cudaError_t launch_gemms(const GemmArgs& g1, const GemmArgs& g2, const Plan& plan, bool tensor_cores,
                         cudaStream_t stream) {
  cudaError_t err;
  if (!tensor_cores) {
    err = launch_simt<Tag, true>(g1, plan.max_tiles, stream);
    if (err != cudaSuccess) return err;
    return launch_simt<Tag, false>(g2, plan.max_tiles, stream);
  }
  if constexpr (!std::is_same<Tag, F32Tag>::value)
    return g1.scale != nullptr ? launch_tc_gemms<Tag, true>(g1, g2, plan, stream)
                               : launch_tc_gemms<Tag, false>(g1, g2, plan, stream);
  return cudaErrorInvalidValue;
}

template <class Tag>
cudaError_t launch_combine(const CombineArgs& c, int64_t T, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>((c.H + kCombineCols - 1) / kCombineCols));
  combine_kernel<Tag><<<grid, kCombineThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

size_t dtype_size(ScalarType t) { return t == ScalarType::kFloat32 ? 4 : 2; }

bool valid_dtype(ScalarType t) {
  return t == ScalarType::kFloat32 || t == ScalarType::kFloat16 || t == ScalarType::kBFloat16;
}

}  // namespace

size_t moe_cuda_workspace_bytes(int64_t num_tokens, int64_t num_experts, int64_t local_experts, int32_t top_k,
                                int64_t hidden_size, int64_t inter_size, int64_t shared_inter_size) {
  if (num_tokens <= 0 || num_experts < 0 || local_experts <= 0 || top_k <= 0 || hidden_size <= 0 ||
      inter_size <= 0 || shared_inter_size < 0)
    return 0;
  return make_plan(num_tokens, num_experts, local_experts, top_k, hidden_size, inter_size, shared_inter_size)
      .total;
}

int moe_cuda(const MoeParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const bool given = p.topk_ids != nullptr;
  const int64_t T = p.num_tokens, H = p.hidden_size, E = given ? 0 : p.num_experts, El = p.local_experts,
                I = p.inter_size, S = p.shared_inter_size;
  if (T < 0 || H < 0 || El <= 0 || I <= 0 || S < 0 || S > INT32_MAX) return cudaErrorInvalidValue;
  if (T == 0 || H == 0) return cudaSuccess;  // empty output
  const int32_t nv = moe_experts::num_virtual(S, I);
  if (El + nv > kMoeMaxExperts || p.top_k < 1 || p.top_k > kMoeMaxTopK) return cudaErrorInvalidValue;
  if (S > 0 && (p.shared_w13 == nullptr || p.shared_w2 == nullptr)) return cudaErrorInvalidValue;
  const bool fp8 = p.weight_dtype == ScalarType::kFloat8E4M3;  // else the weights are in `dtype`
  if (fp8 && (p.w13_scale == nullptr || p.w2_scale == nullptr ||
              (S > 0 && (p.shared_w13_scale == nullptr || p.shared_w2_scale == nullptr))))
    return cudaErrorInvalidValue;
  if (T * (p.top_k + nv) > INT32_MAX) return cudaErrorInvalidValue;
  if (H > INT32_MAX || I > INT32_MAX || T > INT32_MAX / p.top_k) return cudaErrorInvalidValue;
  if (p.expert_offset < 0 || p.expert_offset > INT32_MAX - El) return cudaErrorInvalidValue;
  if (!valid_dtype(p.dtype) || !valid_dtype(p.router_dtype)) return cudaErrorInvalidValue;
  if (p.hidden == nullptr || p.w13 == nullptr || p.w2 == nullptr || p.out == nullptr)
    return cudaErrorInvalidValue;
  const int routings = (p.router_weight != nullptr) + (p.router_logits != nullptr) + given;
  if (routings != 1 || given != (p.topk_weights != nullptr)) return cudaErrorInvalidValue;
  if (!given) {  // the router's checks
    if (E > kMoeMaxExperts || p.top_k > E || p.expert_offset + El > E) return cudaErrorInvalidValue;
    if (p.scoring != MoeScoring::kSoftmax && p.scoring != MoeScoring::kSigmoid) return cudaErrorInvalidValue;
    if (p.num_groups < 1 || E % p.num_groups != 0 || p.topk_groups < 1 || p.topk_groups > p.num_groups)
      return cudaErrorInvalidValue;
    if (p.num_groups > 1 && p.top_k > p.topk_groups * (E / p.num_groups)) return cudaErrorInvalidValue;
  }
  const size_t es = dtype_size(p.dtype), wes = fp8 ? 1 : es;
  for (const void* ptr : {p.hidden, static_cast<const void*>(p.out)})
    if (reinterpret_cast<uintptr_t>(ptr) % es != 0) return cudaErrorInvalidValue;
  for (const void* ptr : {p.w13, p.w2, p.shared_w13, p.shared_w2})
    if (reinterpret_cast<uintptr_t>(ptr) % wes != 0) return cudaErrorInvalidValue;
  if (p.router_weight != nullptr &&
      reinterpret_cast<uintptr_t>(p.router_weight) % dtype_size(p.router_dtype) != 0)
    return cudaErrorInvalidValue;

  const Plan plan = make_plan(T, E, El, p.top_k, H, I, S);
  if (workspace == nullptr || workspace_bytes < plan.total || !aligned16(workspace))
    return cudaErrorInvalidValue;
  if (plan.max_tiles * (plan.bm / kSimtRows) > INT32_MAX || plan.token_tiles > INT32_MAX)
    return cudaErrorInvalidConfiguration;

  cudaError_t err;
  char* ws = static_cast<char*>(workspace);
  err = cudaMemsetAsync(ws + plan.counters, 0, plan.counters_bytes, stream);
  if (err != cudaSuccess) return err;

  RouteArgs ra;
  ra.hidden = p.hidden;
  ra.hidden_dtype = p.dtype;
  ra.router_weight = p.router_weight;
  ra.router_dtype = p.router_dtype;
  ra.given_logits = p.router_logits;
  ra.given_ids = p.topk_ids;
  ra.given_w = p.topk_weights;
  ra.T = static_cast<int32_t>(T);
  ra.H = static_cast<int32_t>(H);
  ra.E = static_cast<int32_t>(E);
  ra.top_k = p.top_k;
  ra.vec4 = H % 4 == 0 && reinterpret_cast<uintptr_t>(p.hidden) % (4 * es) == 0 &&
            (p.router_weight == nullptr ||
             reinterpret_cast<uintptr_t>(p.router_weight) % (4 * dtype_size(p.router_dtype)) == 0);
  ra.scoring = p.scoring;
  ra.renormalize = p.renormalize;
  ra.bias = p.expert_bias;
  ra.num_groups = p.num_groups;
  ra.topk_groups = p.topk_groups;
  ra.scaling = p.routed_scaling;
  ra.e0 = p.expert_offset;
  ra.e1 = static_cast<int32_t>(p.expert_offset + El);
  ra.shared_experts = nv;
  ra.bm = plan.bm;
  ra.logits = reinterpret_cast<float*>(ws + plan.logits);
  ra.tile_counter = reinterpret_cast<int32_t*>(ws + plan.counters);
  ra.done_counter = ra.tile_counter + plan.token_tiles;
  ra.topk_ids = reinterpret_cast<int32_t*>(ws + plan.topk_ids);
  ra.topk_w = reinterpret_cast<float*>(ws + plan.topk_w);
  ra.sorted_ids = reinterpret_cast<int32_t*>(ws + plan.sorted_ids);
  ra.tile_expert = reinterpret_cast<int32_t*>(ws + plan.tile_expert);
  ra.num_tiles = reinterpret_cast<int32_t*>(ws + plan.num_tiles);
  {
    const unsigned chunks = p.router_weight == nullptr
                                ? 1u
                                : static_cast<unsigned>((E + kRouteExpertsPerCta - 1) / kRouteExpertsPerCta);
    const dim3 grid(static_cast<unsigned>(plan.token_tiles), chunks);
    if (plan.route_tt == 4)
      route_kernel<4><<<grid, kRouteThreads, 0, stream>>>(ra);
    else
      route_kernel<16><<<grid, kRouteThreads, 0, stream>>>(ra);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }

  GemmArgs g1;
  g1.a_src = p.hidden;
  g1.w = p.w13;
  g1.w_shared = p.shared_w13;
  g1.scale = fp8 ? p.w13_scale : nullptr;
  g1.scale_shared = fp8 ? p.shared_w13_scale : nullptr;
  g1.act = ws + plan.act;
  g1.ypart = nullptr;
  g1.sorted_ids = ra.sorted_ids;
  g1.tile_expert = ra.tile_expert;
  g1.num_tiles = ra.num_tiles;
  g1.topk_w = ra.topk_w;
  g1.K = static_cast<int32_t>(H);
  g1.N = static_cast<int32_t>(I);
  g1.top_k = p.top_k;
  g1.bm = plan.bm;
  g1.T = static_cast<int32_t>(T);
  g1.local_experts = static_cast<int32_t>(El);
  g1.H = static_cast<int32_t>(H);
  g1.I = static_cast<int32_t>(I);
  g1.S = static_cast<int32_t>(S);
  GemmArgs g2 = g1;
  g2.a_src = ws + plan.act;
  g2.w = p.w2;
  g2.w_shared = p.shared_w2;
  g2.scale = fp8 ? p.w2_scale : nullptr;
  g2.scale_shared = fp8 ? p.shared_w2_scale : nullptr;
  g2.act = nullptr;
  g2.ypart = reinterpret_cast<float*>(ws + plan.ypart);
  g2.K = static_cast<int32_t>(I);
  g2.N = static_cast<int32_t>(H);

  // 16-byte chunks of weights wholly inside or outside every row and slice: 8 b16 weights, or 16 FP8
  // ones (then also inside one 128-column scale block).
  const int64_t chunk = fp8 ? 16 : 8;
  const bool tensor_cores = p.dtype != ScalarType::kFloat32 && H % chunk == 0 && I % chunk == 0 &&
                            S % chunk == 0 && aligned16(p.hidden) && aligned16(p.w13) && aligned16(p.w2) &&
                            (S == 0 || (aligned16(p.shared_w13) && aligned16(p.shared_w2)));
  switch (p.dtype) {
    case ScalarType::kFloat32:
      err = launch_gemms<F32Tag>(g1, g2, plan, false, stream);
      break;
    case ScalarType::kFloat16:
      err = launch_gemms<F16Tag>(g1, g2, plan, tensor_cores, stream);
      break;
    default:
      err = launch_gemms<BF16Tag>(g1, g2, plan, tensor_cores, stream);
      break;
  }
  if (err != cudaSuccess) return err;

  CombineArgs c;
  c.ypart = g2.ypart;
  c.topk_ids = ra.topk_ids;
  c.out = p.out;
  c.T = static_cast<int32_t>(T);
  c.H = static_cast<int32_t>(H);
  c.shared_experts = nv;
  c.top_k = p.top_k;
  c.e0 = ra.e0;
  c.e1 = ra.e1;
  c.vec4 = H % 4 == 0;
  switch (p.dtype) {
    case ScalarType::kFloat32:
      return launch_combine<F32Tag>(c, T, stream);
    case ScalarType::kFloat16:
      return launch_combine<F16Tag>(c, T, stream);
    default:
      return launch_combine<BF16Tag>(c, T, stream);
  }
}

}  // namespace dinfer_kernels
