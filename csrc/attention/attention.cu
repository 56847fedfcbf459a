// CUDA backend of block-sparse window attention with partial KV refresh.
// Contract: dinfer_kernels/reference/attention.py.
//
// Up to three launches, no host synchronisation and no allocation (CUDA-graph capturable):
//   1. refresh_prologue_kernel: one CTA per window row. A valid row's fresh K/V replace its cache
//      row (write_back = false: the old row is saved to the workspace first). Extra CTAs fill the
//      per-block statistics scratch with -inf when block_mass is wanted.
//   2. attention_fwd_kernel: flash-attention forward on the sm_80 tensor cores (mma.sync
//      m16n8k16, ldmatrix, cp.async double buffering, online softmax in the exp2 domain). One CTA
//      per (sequence, kv head, query block, 64-row query tile, key split); the query tile packs the
//      (row, head) pairs of the kv head's GQA group, so K/V are read once per group. The CTA visits
//      only the key blocks its query block lists, in 64-key tiles.
//   3. attention_epilogue_kernel (when there are splits, block statistics or a cache to restore):
//      combines the splits' partial outputs by their log-sum-exps, finishes block_mass from the
//      per-(row, block) log-sum-exps and the rows' final ones, and restores saved cache rows.
// Every cache row is found through attention_math::kv_slot (contiguous caches, or page pools through
// a block table): rows of absent pages are neither written nor restored, and the forward kernel
// neither loads them (zero-filled) nor attends them (a per-key flag next to each K/V buffer).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/ptx.cuh"
#include "common/workspace.h"
#include "dinfer_kernels/attention.h"
#include "dinfer_kernels/detail/attention_math.h"
#include "dinfer_kernels/detail/mma_layout.h"
#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/detail/simt.h"

namespace dinfer_kernels {
namespace {

using attention_math::KeyTile;
using attention_math::KeyWalk;
using attention_math::kTileM;
using attention_math::kTileN;
using attention_math::kv_offset;
using attention_math::kv_slot;
using attention_math::KvLayout;
using attention_math::KvSlot;
using dtype::BF16Tag;
using dtype::F16Tag;
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::mma_16816;
using ptx::pack2;
using scalar::kLn2;
using scalar::kLog2e;
using workspace::align_up;
using workspace::aligned16;

// 4 warps; warp w owns packed query rows [16w, 16w + 16) of the tile. Every shared-memory offset
// and fragment coordinate comes from mma_layout::AttentionTiles (tested lane by lane on the host).
constexpr int kThreads = mma_layout::kAttentionThreads;
template <int kD>
using Tiles = mma_layout::AttentionTiles<kD>;
constexpr int kAuxThreads = 128;  // prologue and epilogue CTAs

using scalar::fast_exp2;  // ex2(-inf) = +0: the masking relies on it

__device__ __forceinline__ int32_t imin(int32_t a, int32_t b) { return a < b ? a : b; }

// ---- the attention kernel ------------------------------------------------------------------------

struct FwdArgs {
  const uint16_t* q;
  int64_t qs[3];
  const uint16_t* k_cache;
  int64_t kcs[3];
  const uint16_t* v_cache;
  int64_t vcs[3];
  const int64_t* positions;  // [B, W]
  const int32_t* seq_lens;  // [B]
  KvLayout kv;  // where the cache rows are (contiguous or paged)
  const int32_t* kv_num_blocks;  // [B, Hkv, NQB] or null
  const int32_t* kv_indices;  // [B, Hkv, NQB, max_blocks] or null
  int32_t max_blocks;
  int32_t B, W, Hq, Hkv, G, S;
  int32_t q_block, nqb, n_mt, ns;
  int32_t walk_kv_block;  // key-block size the walk uses (kTileN for the implicit dense list)
  int32_t walk_nkb;  // cdiv(S, walk_kv_block)
  int32_t tiles_per_block;
  int32_t nkb;  // NKB of block_mass (the caller's kv_block)
  float scale_log2;  // scale * log2(e)
  uint16_t* out;
  int64_t os[3];
  float* lse;  // [B, W, Hq] natural log, or null
  float* part_o;  // [ns, B, W, Hq, D] (ns > 1)
  float* part_lse;  // [ns, B, W, Hq] log2 domain (ns > 1 or block statistics)
  float* lsekb;  // [B, Hq, NKB, W] log2-domain lse of each (row, key block), or null
};

// Q + 2 x (K, V), then the two buffers' key flags (one byte per key).
template <int kD>
constexpr size_t fwd_smem_bytes() {
  return static_cast<size_t>(Tiles<kD>::kSmemElems) * sizeof(uint16_t) + 2 * kTileN;
}

// One K/V tile (keys [t.k0, t.k1)) into the given buffers, and its key flags: flag r = 1 for a key
// that is attended (r < t.k1 - t.k0, its page present). Rows of other keys are zero-filled (never
// read from memory), so their scores are finite before the flags mask them and their values
// contribute exact zeros. The thread copying chunk 0 of a row writes its flag.
template <int kD>
__device__ __forceinline__ void load_kv_tile(uint16_t* sk, uint16_t* sv, uint8_t* flags, const FwdArgs& a,
                                             int b, int g, const KeyTile& t, int tid) {
  using T = Tiles<kD>;
  const uint16_t* kbase = a.k_cache + g * a.kcs[2];
  const uint16_t* vbase = a.v_cache + g * a.vcs[2];
  const int n = t.k1 - t.k0;
  DINFER_UNROLL
  for (int i = 0; i < T::kKVRounds; ++i) {
    const int r = T::copy_row(tid, i), ch = T::copy_chunk(tid, i);
    const KvSlot at = kv_slot(a.kv, b, t.k0 + (r < n ? r : 0));  // a key < L either way
    const bool ok = r < n && at.present;
    if (ch == 0) flags[r] = ok ? 1 : 0;
    cp_async16(sk + T::copy_offset(tid, i), kbase + kv_offset(a.kcs, at, 0) + ch * 8, ok);
    cp_async16(sv + T::copy_offset(tid, i), vbase + kv_offset(a.vcs, at, 0) + ch * 8, ok);
  }
}

template <class Tag, int kD, bool kMass>
__global__ void __launch_bounds__(kThreads, 2) attention_fwd_kernel(const __grid_constant__ FwdArgs a) {
  using T = Tiles<kD>;
  constexpr int kDT = T::kDT;  // n8 tiles of the output per warp
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint16_t* sq = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sk = sq + T::kKBase;  // [2][kTileN][kD]
  uint16_t* sv = sq + T::kVBase;  // [2][kTileN][kD]
  uint8_t* sflags = reinterpret_cast<uint8_t*>(sq + T::kSmemElems);  // [2][kTileN]

  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int tig = lane % 4;  // the quad's lane 0 writes the per-row statistics

  // Work unit. Flattened so that neighbouring CTAs share (sequence, kv head, split): the same keys.
  uint32_t bid = blockIdx.x;
  const int mt = static_cast<int>(bid % static_cast<uint32_t>(a.n_mt));
  bid /= static_cast<uint32_t>(a.n_mt);
  const int j = static_cast<int>(bid % static_cast<uint32_t>(a.nqb));
  bid /= static_cast<uint32_t>(a.nqb);
  const int split = static_cast<int>(bid % static_cast<uint32_t>(a.ns));
  bid /= static_cast<uint32_t>(a.ns);
  const int g = static_cast<int>(bid % static_cast<uint32_t>(a.Hkv));
  const int b = static_cast<int>(bid / static_cast<uint32_t>(a.Hkv));

  const int w0 = j * a.q_block;
  const int nrows = imin(a.q_block, a.W - w0);
  const int P = nrows * a.G;  // packed (row, head) pairs of this query block: p = r * G + hh
  const int p0 = mt * kTileM;
  if (p0 >= P) return;  // CTA-uniform: the last query block is shorter
  const int32_t L = attention_math::valid_len(a.seq_lens[b], a.S);

  // This CTA's part of the key list.
  KeyWalk walk;
  walk.num_blocks = a.walk_nkb;
  walk.kv_block = a.walk_kv_block;
  walk.tiles_per_block = a.tiles_per_block;
  walk.len = L;
  int64_t count;
  if (a.kv_num_blocks != nullptr) {
    const int64_t row = (static_cast<int64_t>(b) * a.Hkv + g) * a.nqb + j;
    const int32_t c = a.kv_num_blocks[row];
    count = c < 0 ? 0 : (c > a.max_blocks ? a.max_blocks : c);
    walk.list = a.kv_indices + row * a.max_blocks;
  } else {
    count = attention_math::cdiv(L, a.walk_kv_block);
    walk.list = nullptr;
  }
  int64_t ord0, ord1;
  if (kMass) {  // whole blocks per split
    attention_math::split_range(count, split, a.ns, &ord0, &ord1);
    ord0 *= a.tiles_per_block;
    ord1 *= a.tiles_per_block;
  } else {
    attention_math::split_range(count * a.tiles_per_block, split, a.ns, &ord0, &ord1);
  }

  // Q tile: packed rows [p0, p0 + 64), zero past P.
  {
    const uint16_t* qb = a.q + b * a.qs[0];
    DINFER_UNROLL
    for (int i = 0; i < T::kQRounds; ++i) {
      const int r = T::copy_row(tid, i), ch = T::copy_chunk(tid, i);
      const int p = p0 + r;
      const bool ok = p < P;
      const int w = w0 + (ok ? p / a.G : 0);
      const int h = g * a.G + (ok ? p % a.G : 0);
      cp_async16(sq + T::copy_offset(tid, i), qb + w * a.qs[1] + h * a.qs[2] + ch * 8, ok);
    }
  }
  KeyTile cur = attention_math::find_tile(walk, ord0, ord1);
  if (cur.valid()) load_kv_tile<kD>(sk, sv, sflags, a, b, g, cur, tid);
  cp_async_commit();

  // Per thread: rows r0 = T::acc_row(warp, lane, 0) and r1 = r0 + 8 of the tile (index 0 / 1 below).
  float o[kDT][4];
  DINFER_UNROLL
  for (int dt = 0; dt < kDT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY};  // running max of the log2-scaled scores
  float l[2] = {0.f, 0.f};  // this thread's part of sum 2^(x - m)
  float bm[2] = {0.f, 0.f};  // same, over the current key block only (kMass)
  int buf = 0;

  // ldmatrix addresses (Tiles::q_frag, k_frag, v_frag): Q rows give the A fragment of Q K^T; K
  // rows (n-major) the B fragments of two key n8 tiles per load; V rows (k-major), loaded .trans,
  // the B fragments of two output n8 tiles per load.

  while (cur.valid()) {
    const KeyTile nxt = attention_math::find_tile(walk, cur.ord + 1, ord1);
    if (nxt.valid()) {
      load_kv_tile<kD>(sk + (buf ^ 1) * T::kBufElems, sv + (buf ^ 1) * T::kBufElems,
                       sflags + (buf ^ 1) * kTileN, a, b, g, nxt, tid);
      cp_async_commit();
      cp_async_wait<1>();  // everything but the prefetch has landed (Q and this tile)
    } else {
      cp_async_wait<0>();
    }
    simt::sync_block();
    const uint16_t* kt = sk + buf * T::kBufElems;
    const uint16_t* vt = sv + buf * T::kBufElems;

    // S = Q K^T: 16 rows x 64 keys per warp, s[nt] is the n8 tile of keys [8nt, 8nt + 8).
    float s[8][4];
    DINFER_UNROLL
    for (int nt = 0; nt < 2 * T::kKeyChunks; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    DINFER_UNROLL
    for (int kk = 0; kk < T::kKSteps; ++kk) {
      uint32_t qa[4];
      ptx::ldmatrix_x4(qa, sq + T::q_frag(warp, lane, kk));
      DINFER_UNROLL
      for (int np = 0; np < T::kKeyChunks; ++np) {
        uint32_t kf[4];
        ptx::ldmatrix_x4(kf, kt + T::k_frag(lane, kk, np));
        mma_16816(s[2 * np], qa, kf[0], kf[1], Tag{});
        mma_16816(s[2 * np + 1], qa, kf[2], kf[3], Tag{});
      }
    }

    // Online softmax. s[nt][i] is row (i < 2 ? r0 : r1), key column T::acc_col(lane, nt, i); the
    // tile's key flags mask the keys it does not attend (past its end, or of absent pages). Columns
    // acc_col(lane, nt, 0) and + 1 are two adjacent flag bytes: one 16-bit load.
    const uint8_t* tflags = sflags + buf * kTileN;
    float mx[2] = {-INFINITY, -INFINITY};
    DINFER_UNROLL
    for (int nt = 0; nt < 8; ++nt) {
      const uint32_t pair = *reinterpret_cast<const uint16_t*>(tflags + T::acc_col(lane, nt, 0));
      DINFER_UNROLL
      for (int i = 0; i < 4; ++i) {
        const bool attended = (pair >> (8 * (i & 1))) & 1u;  // acc_col(lane, nt, i) = acc_col(.., 0) + i % 2
        const float x = attended ? s[nt][i] * a.scale_log2 : -INFINITY;
        s[nt][i] = x;
        mx[i >> 1] = fmaxf(mx[i >> 1], x);
      }
    }
    float mu[2], alpha[2];
    DINFER_UNROLL
    for (int r = 0; r < 2; ++r) {  // the 4 lanes of a quad share a row
      mx[r] = fmaxf(mx[r], simt::shfl_xor(mx[r], 1));
      mx[r] = fmaxf(mx[r], simt::shfl_xor(mx[r], 2));
      const float mnew = fmaxf(m[r], mx[r]);
      mu[r] = mnew == -INFINITY ? 0.f : mnew;  // no finite score yet: keep 2^(-inf - 0) = 0
      alpha[r] = fast_exp2(m[r] - mu[r]);  // m = -inf: 0 (nothing accumulated yet)
      m[r] = mnew;
    }
    float rs[2] = {0.f, 0.f};
    DINFER_UNROLL
    for (int nt = 0; nt < 8; ++nt) {
      DINFER_UNROLL
      for (int i = 0; i < 4; ++i) {
        const float p = fast_exp2(s[nt][i] - mu[i >> 1]);
        s[nt][i] = p;
        rs[i >> 1] += p;
      }
    }
    DINFER_UNROLL
    for (int r = 0; r < 2; ++r) {
      l[r] = l[r] * alpha[r] + rs[r];
      if (kMass) bm[r] = bm[r] * alpha[r] + rs[r];
    }
    DINFER_UNROLL
    for (int dt = 0; dt < kDT; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
    }

    // O += P V. The C fragments of key n-tiles 2kc and 2kc+1 are exactly the A fragment of the
    // 16-key chunk kc (T::p_tile, p_reg).
    DINFER_UNROLL
    for (int kc = 0; kc < T::kKeyChunks; ++kc) {
      const uint32_t pa[4] = {
          pack2(s[T::p_tile(kc, 0)][T::p_reg(0, 0)], s[T::p_tile(kc, 0)][T::p_reg(0, 1)], Tag{}),
          pack2(s[T::p_tile(kc, 1)][T::p_reg(1, 0)], s[T::p_tile(kc, 1)][T::p_reg(1, 1)], Tag{}),
          pack2(s[T::p_tile(kc, 2)][T::p_reg(2, 0)], s[T::p_tile(kc, 2)][T::p_reg(2, 1)], Tag{}),
          pack2(s[T::p_tile(kc, 3)][T::p_reg(3, 0)], s[T::p_tile(kc, 3)][T::p_reg(3, 1)], Tag{})};
      DINFER_UNROLL
      for (int dp = 0; dp < T::kKSteps; ++dp) {
        uint32_t vf[4];
        ptx::ldmatrix_x4_trans(vf, vt + T::v_frag(lane, kc, dp));
        mma_16816(o[2 * dp], pa, vf[0], vf[1], Tag{});
        mma_16816(o[2 * dp + 1], pa, vf[2], vf[3], Tag{});
      }
    }

    if (kMass && cur.last) {  // CTA-uniform: the block's mass is complete for these rows
      DINFER_UNROLL
      for (int r = 0; r < 2; ++r) {
        float v = bm[r] + simt::shfl_xor(bm[r], 1);
        v += simt::shfl_xor(v, 2);
        const int p = p0 + T::acc_row(warp, lane, 2 * r);
        if (tig == 0 && p < P) {
          const int w = w0 + p / a.G, h = g * a.G + p % a.G;
          if (attention_math::row_valid(a.positions[static_cast<int64_t>(b) * a.W + w], L))
            a.lsekb[((static_cast<int64_t>(b) * a.Hq + h) * a.nkb + cur.kb) * a.W + w] =
                v != 0.f ? mu[r] + log2f(v) : -INFINITY;  // != keeps NaN
        }
        bm[r] = 0.f;
      }
    }
    simt::sync_block();  // everyone is done with `buf` before the next iteration refills it
    cur = nxt;
    buf ^= 1;
  }
  cp_async_wait<0>();  // no tile at all: the Q group may still be in flight

  // Epilogue: per row, normalise and store (one split) or store the split's partial state.
  DINFER_UNROLL
  for (int r = 0; r < 2; ++r) {
    l[r] += simt::shfl_xor(l[r], 1);
    l[r] += simt::shfl_xor(l[r], 2);
  }
  DINFER_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int p = p0 + T::acc_row(warp, lane, 2 * r);
    if (p >= P) continue;
    const int w = w0 + p / a.G, h = g * a.G + p % a.G;
    const int64_t bw = static_cast<int64_t>(b) * a.W + w;
    const bool valid = attention_math::row_valid(a.positions[bw], L);
    const bool any = valid && l[r] != 0.f;  // a NaN sum (NaN / +inf score) propagates
    const float inv = any ? 1.f / l[r] : 0.f;
    const float lse2 = any ? m[r] + log2f(l[r]) : -INFINITY;
    const int64_t row = bw * a.Hq + h;  // (b, w, h)
    if (a.ns == 1) {
      uint16_t* orow = a.out + b * a.os[0] + w * a.os[1] + h * a.os[2];
      // Exact zeros for padding rows: their (poisoned) queries may have made o NaN.
      DINFER_UNROLL
      for (int dt = 0; dt < kDT; ++dt)
        *reinterpret_cast<uint32_t*>(orow + T::acc_col(lane, dt, 2 * r)) =
            any ? pack2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv, Tag{}) : 0u;
      if (tig == 0) {
        if (a.lse != nullptr) a.lse[row] = lse2 * kLn2;
        if (a.part_lse != nullptr && valid) a.part_lse[row] = lse2;
      }
    } else if (valid) {  // the combine writes padding rows itself
      const int64_t srow = static_cast<int64_t>(split) * a.B * a.W * a.Hq + row;
      float* prow = a.part_o + srow * kD;
      DINFER_UNROLL
      for (int dt = 0; dt < kDT; ++dt)
        *reinterpret_cast<float2*>(prow + T::acc_col(lane, dt, 2 * r)) =
            make_float2(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
      if (tig == 0) a.part_lse[srow] = lse2;
    }
  }
}

// ---- refresh prologue ------------------------------------------------------------------------------

struct PrologueArgs {
  const uint16_t* k;
  int64_t ks[3];
  const uint16_t* v;
  int64_t vs[3];
  uint16_t* k_cache;
  int64_t kcs[3];
  uint16_t* v_cache;
  int64_t vcs[3];
  const int64_t* positions;
  const int32_t* seq_lens;
  KvLayout kv;
  int32_t W, Hkv, D, S;
  int32_t row_ctas;  // B * W
  uint16_t* saved;  // [2, B, W, Hkv, D] (write_back = false) or null
  float* lsekb;  // filled with -inf, or null
  int64_t lsekb_n;
};

__global__ void __launch_bounds__(kAuxThreads)
    refresh_prologue_kernel(const __grid_constant__ PrologueArgs a) {
  const int tid = static_cast<int>(threadIdx.x);
  const int cta = static_cast<int>(blockIdx.x);
  if (cta < a.row_ctas) {
    const int b = cta / a.W, w = cta % a.W;
    const int32_t L = attention_math::valid_len(a.seq_lens[b], a.S);
    const int64_t pos = a.positions[cta];
    if (!attention_math::row_valid(pos, L)) return;  // padding rows are never written
    const KvSlot at = kv_slot(a.kv, b, static_cast<int32_t>(pos));
    if (!at.present) return;  // nor are rows of absent pages
    const int chunks = a.D / 8;
    const int64_t rowsz = static_cast<int64_t>(a.Hkv) * a.D;
    for (int c = tid; c < a.Hkv * chunks; c += kAuxThreads) {
      const int h = c / chunks, d = (c % chunks) * 8;
      const uint4 fk = *reinterpret_cast<const uint4*>(a.k + b * a.ks[0] + w * a.ks[1] + h * a.ks[2] + d);
      const uint4 fv = *reinterpret_cast<const uint4*>(a.v + b * a.vs[0] + w * a.vs[1] + h * a.vs[2] + d);
      uint4* ck = reinterpret_cast<uint4*>(a.k_cache + kv_offset(a.kcs, at, h) + d);
      uint4* cv = reinterpret_cast<uint4*>(a.v_cache + kv_offset(a.vcs, at, h) + d);
      if (a.saved != nullptr) {
        const int64_t off = static_cast<int64_t>(cta) * rowsz + h * a.D + d;
        *reinterpret_cast<uint4*>(a.saved + off) = *ck;
        *reinterpret_cast<uint4*>(a.saved + static_cast<int64_t>(a.row_ctas) * rowsz + off) = *cv;
      }
      *ck = fk;
      *cv = fv;
    }
  } else {
    const int64_t nthreads =
        static_cast<int64_t>(gridDim.x - static_cast<uint32_t>(a.row_ctas)) * kAuxThreads;
    for (int64_t i = static_cast<int64_t>(cta - a.row_ctas) * kAuxThreads + tid; i < a.lsekb_n; i += nthreads)
      a.lsekb[i] = -INFINITY;
  }
}

// ---- epilogue: split combine, block mass, cache restore ----------------------------------------------

struct EpilogueArgs {
  const int64_t* positions;
  const int32_t* seq_lens;
  int32_t B, W, Hq, Hkv, D, S, ns, nkb;
  int32_t combine_ctas, mass_ctas;  // roles: [0, combine) [combine, + mass) [.., + restore)
  const float* part_o;
  const float* part_lse;
  const float* lsekb;
  uint16_t* out;
  int64_t os[3];
  float* lse;
  float* block_mass;
  // restore
  const uint16_t* saved;
  uint16_t* k_cache;
  int64_t kcs[3];
  uint16_t* v_cache;
  int64_t vcs[3];
  KvLayout kv;
};

// Final log2-domain lse of row `row` = (b, w, h) from the splits' partial ones.
__device__ __forceinline__ float row_lse2(const EpilogueArgs& a, int64_t row) {
  return attention_math::splits_lse2(a.part_lse + row, a.ns, static_cast<int64_t>(a.B) * a.W * a.Hq);
}

template <class Tag>
__global__ void __launch_bounds__(kAuxThreads)
    attention_epilogue_kernel(const __grid_constant__ EpilogueArgs a) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int cta = static_cast<int>(blockIdx.x);
  if (cta < a.combine_ctas) {
    // One warp per (b, w, h) row; lane s holds split s's lse (ns <= 32).
    const int64_t row = static_cast<int64_t>(cta) * (kAuxThreads / 32) + warp;
    if (row >= static_cast<int64_t>(a.B) * a.W * a.Hq) return;
    const int64_t bw = row / a.Hq;
    const int h = static_cast<int>(row % a.Hq), w = static_cast<int>(bw % a.W);
    const int b = static_cast<int>(bw / a.W);
    uint16_t* orow = a.out + b * a.os[0] + w * a.os[1] + h * a.os[2];
    const int32_t L = attention_math::valid_len(a.seq_lens[b], a.S);
    const int64_t stride = static_cast<int64_t>(a.B) * a.W * a.Hq;
    const bool valid = attention_math::row_valid(a.positions[bw], L);  // padding rows: no partials
    const float lse2 = valid ? row_lse2(a, row) : -INFINITY;
    const float ls = valid && lane < a.ns ? a.part_lse[lane * stride + row] : -INFINITY;
    attention_math::combine_columns(
        a.part_o + row * a.D, stride * a.D, a.D, a.ns, attention_math::split_share(ls, lse2), lane,
        [&](int d, float x0, float x1) { *reinterpret_cast<uint32_t*>(orow + d) = pack2(x0, x1, Tag{}); });
    if (lane == 0 && a.lse != nullptr) a.lse[row] = lse2 * kLn2;
    return;
  }
  if (cta < a.combine_ctas + a.mass_ctas) {
    // One CTA per (b, h, key block): sum over valid rows of 2^(lse2(row, kb) - lse2(row)).
    __shared__ float red[kAuxThreads / 32];
    const int64_t idx = cta - a.combine_ctas;
    const int kb = static_cast<int>(idx % a.nkb);
    const int64_t bh = idx / a.nkb;
    const int h = static_cast<int>(bh % a.Hq), b = static_cast<int>(bh / a.Hq);
    const int32_t L = attention_math::valid_len(a.seq_lens[b], a.S);
    const float* lk = a.lsekb + (bh * a.nkb + kb) * a.W;
    float acc = 0.f;
    for (int w = tid; w < a.W; w += kAuxThreads) {
      const int64_t bw = static_cast<int64_t>(b) * a.W + w;
      if (!attention_math::row_valid(a.positions[bw], L)) continue;
      const float x = lk[w];
      if (x == -INFINITY) continue;
      acc += exp2f(x - row_lse2(a, bw * a.Hq + h));
    }
    acc = simt::warp_sum(acc);
    if (lane == 0) red[warp] = acc;
    simt::sync_block();
    if (tid == 0) {
      float t = 0.f;
      for (int i = 0; i < kAuxThreads / 32; ++i) t += red[i];
      a.block_mass[bh * a.nkb + kb] = t;
    }
    return;
  }
  // Restore one window row of both caches (write_back = false).
  const int r = cta - a.combine_ctas - a.mass_ctas;
  const int b = r / a.W;
  const int32_t L = attention_math::valid_len(a.seq_lens[b], a.S);
  const int64_t pos = a.positions[r];
  if (!attention_math::row_valid(pos, L)) return;
  const KvSlot at = kv_slot(a.kv, b, static_cast<int32_t>(pos));
  if (!at.present) return;  // the prologue wrote nothing there
  const int chunks = a.D / 8;
  const int64_t rowsz = static_cast<int64_t>(a.Hkv) * a.D;
  const int64_t rows = static_cast<int64_t>(a.B) * a.W;
  for (int c = tid; c < a.Hkv * chunks; c += kAuxThreads) {
    const int h = c / chunks, d = (c % chunks) * 8;
    const int64_t off = static_cast<int64_t>(r) * rowsz + h * a.D + d;
    *reinterpret_cast<uint4*>(a.k_cache + kv_offset(a.kcs, at, h) + d) =
        *reinterpret_cast<const uint4*>(a.saved + off);
    *reinterpret_cast<uint4*>(a.v_cache + kv_offset(a.vcs, at, h) + d) =
        *reinterpret_cast<const uint4*>(a.saved + rows * rowsz + off);
  }
}

// ---- host side -------------------------------------------------------------------------------------

// Everything the launcher derives from the shapes alone.
struct Plan {
  int64_t G, nqb, n_mt, units;
  int64_t walk_kv_block, walk_nkb, tiles_per_block, nkb;
  int ns;
  size_t part_o, part_lse, lsekb, saved, total;  // workspace offsets and size
};

Plan make_plan(int64_t B, int64_t W, int64_t Hq, int64_t Hkv, int64_t D, int64_t S, int64_t q_block,
               int64_t kv_block, int64_t max_blocks, bool write_back, bool mass) {
  using attention_math::cdiv;
  Plan pl;
  pl.G = Hkv > 0 ? Hq / Hkv : 0;
  pl.nqb = attention_num_q_blocks(W, q_block);
  const int64_t rows = q_block < W ? q_block : W;
  pl.n_mt = cdiv(rows * pl.G, kTileM);
  pl.units = B * Hkv * pl.nqb * pl.n_mt;
  const bool has_list = max_blocks >= 0;
  // Without a list and without block statistics the blocks are only a tiling: walk in tiles.
  pl.walk_kv_block = has_list || mass ? kv_block : kTileN;
  pl.walk_nkb = attention_num_kv_blocks(S, pl.walk_kv_block);
  const int64_t span = pl.walk_kv_block < S ? pl.walk_kv_block : S;
  pl.tiles_per_block = span > 0 ? cdiv(span, kTileN) : 1;
  pl.nkb = attention_num_kv_blocks(S, kv_block);
  const int64_t slots = has_list ? max_blocks : pl.walk_nkb;
  pl.ns = attention_math::num_splits(pl.units, slots, pl.tiles_per_block, mass);
  const size_t rows_bwh = static_cast<size_t>(B * W * Hq);
  size_t off = 0;
  pl.part_o = off;
  if (pl.ns > 1) off = align_up(off + static_cast<size_t>(pl.ns) * rows_bwh * D * sizeof(float));
  pl.part_lse = off;
  if (pl.ns > 1 || mass) off = align_up(off + static_cast<size_t>(pl.ns) * rows_bwh * sizeof(float));
  pl.lsekb = off;
  if (mass) off = align_up(off + static_cast<size_t>(B * Hq * pl.nkb * W) * sizeof(float));
  pl.saved = off;
  if (!write_back) off = align_up(off + 2 * static_cast<size_t>(B * W * Hkv * D) * sizeof(uint16_t));
  pl.total = off;
  return pl;
}

bool strides_ok(const int64_t (&s)[3]) { return s[0] % 8 == 0 && s[1] % 8 == 0 && s[2] % 8 == 0; }

template <class Args>
cudaError_t launch(void (*kernel)(Args), int64_t grid, int block, size_t smem, cudaStream_t stream,
                   const Args& args) {
  void* kargs[] = {const_cast<Args*>(&args)};
  return cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(static_cast<unsigned>(grid)),
                          dim3(static_cast<unsigned>(block)), kargs, smem, stream);
}

// With fa == nullptr: only raises the kernel's dynamic shared-memory limit (done before anything is
// launched, so a failure cannot leave a window-refreshed cache behind). Otherwise: launches it.
template <class Tag, int kD, bool kMass>
cudaError_t launch_fwd(const FwdArgs* fa, int64_t grid, cudaStream_t stream) {
  constexpr size_t smem = fwd_smem_bytes<kD>();
  auto kernel = attention_fwd_kernel<Tag, kD, kMass>;
  if (fa == nullptr)
    return smem > 48 * 1024
               ? cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem))
               : cudaSuccess;
  return launch(kernel, grid, kThreads, smem, stream, *fa);
}

template <class Tag>
cudaError_t launch_fwd_dispatch(const FwdArgs* fa, int64_t D, bool mass, int64_t grid, cudaStream_t stream) {
  if (D == 64)
    return mass ? launch_fwd<Tag, 64, true>(fa, grid, stream) : launch_fwd<Tag, 64, false>(fa, grid, stream);
  return mass ? launch_fwd<Tag, 128, true>(fa, grid, stream) : launch_fwd<Tag, 128, false>(fa, grid, stream);
}

void copy3(int64_t (&dst)[3], const int64_t (&src)[3]) {
  dst[0] = src[0];
  dst[1] = src[1];
  dst[2] = src[2];
}

}  // namespace

int attention_cuda_num_splits(int64_t batch, int64_t window, int64_t heads_q, int64_t heads_kv,
                              int64_t cache_len, int64_t q_block, int64_t kv_block, int64_t max_blocks,
                              bool block_mass) {
  if (batch < 0 || window < 0 || heads_q < 1 || heads_kv < 1 || cache_len < 0 || q_block < 1 || kv_block < 1)
    return 1;
  return make_plan(batch, window, heads_q, heads_kv, 64, cache_len, q_block, kv_block, max_blocks, true,
                   block_mass)
      .ns;
}

size_t attention_cuda_workspace_bytes(int64_t batch, int64_t window, int64_t heads_q, int64_t heads_kv,
                                      int64_t head_dim, int64_t cache_len, int64_t q_block, int64_t kv_block,
                                      int64_t max_blocks, bool write_back, bool block_mass) {
  if (batch < 0 || window < 0 || heads_q < 1 || heads_kv < 1 || head_dim < 0 || cache_len < 0 ||
      q_block < 1 || kv_block < 1)
    return 0;
  return make_plan(batch, window, heads_q, heads_kv, head_dim, cache_len, q_block, kv_block, max_blocks,
                   write_back, block_mass)
      .total;
}

int attention_cuda(const AttentionParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const int64_t B = p.batch, W = p.window, Hq = p.heads_q, Hkv = p.heads_kv, D = p.head_dim, S = p.cache_len;
  // ---- parameters (nothing is launched unless all hold) ----
  if (B < 0 || W < 0 || S < 0 || Hkv < 1 || Hq < Hkv || Hq % Hkv != 0) return cudaErrorInvalidValue;
  if (D != 64 && D != 128) return cudaErrorInvalidValue;
  if (p.dtype != ScalarType::kBFloat16 && p.dtype != ScalarType::kFloat16) return cudaErrorInvalidValue;
  if (p.q_block < 1 || p.kv_block < 1 || !std::isfinite(p.scale)) return cudaErrorInvalidValue;
  constexpr int64_t kMaxLen = int64_t{1} << 30;  // int32 row/key arithmetic with margin
  if (W >= kMaxLen || S >= kMaxLen || B >= kMaxLen || Hq > 65536) return cudaErrorInvalidValue;
  const bool has_list = p.kv_num_blocks != nullptr;
  // A list of MAXB = 0 entries may have a null data pointer (a 0-byte array): nothing reads it.
  if (has_list ? (p.kv_indices == nullptr && p.max_blocks != 0) : p.kv_indices != nullptr)
    return cudaErrorInvalidValue;
  if (has_list && (p.max_blocks < 0 || p.max_blocks >= kMaxLen)) return cudaErrorInvalidValue;
  if (p.block_table != nullptr &&
      (p.page_size < 1 || p.num_pages < 1 || p.max_pages < 0 || p.page_size >= kMaxLen ||
       p.max_pages >= kMaxLen || p.max_pages * p.page_size != S))
    return cudaErrorInvalidValue;
  const KvLayout kv = attention_math::kv_layout(p);
  const bool mass = p.block_mass != nullptr;
  if (B * W > 0 &&
      (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr || p.positions == nullptr))
    return cudaErrorInvalidValue;
  if (B > 0 && p.seq_lens == nullptr) return cudaErrorInvalidValue;
  if (B * S > 0 && (p.k_cache == nullptr || p.v_cache == nullptr)) return cudaErrorInvalidValue;
  for (const void* ptr : {p.q, p.k, p.v, static_cast<const void*>(p.k_cache),
                          static_cast<const void*>(p.v_cache), static_cast<const void*>(p.out)})
    if (!aligned16(ptr)) return cudaErrorInvalidValue;
  if (!strides_ok(p.q_stride) || !strides_ok(p.k_stride) || !strides_ok(p.v_stride) ||
      !strides_ok(p.k_cache_stride) || !strides_ok(p.v_cache_stride) || !strides_ok(p.out_stride))
    return cudaErrorInvalidValue;

  const Plan pl =
      make_plan(B, W, Hq, Hkv, D, S, p.q_block, p.kv_block, has_list ? p.max_blocks : -1, p.write_back, mass);
  // Packed (row, head) pairs of a query block are int32 in the kernel.
  if (attention_math::min64(p.q_block, W) * pl.G >= kMaxLen) return cudaErrorInvalidValue;
  if (workspace_bytes < pl.total || (pl.total > 0 && (workspace == nullptr || !aligned16(workspace))))
    return cudaErrorInvalidValue;
  const int64_t fwd_grid = pl.units * pl.ns;
  const int64_t rows = B * W;
  const int64_t lsekb_n = mass ? B * Hq * pl.nkb * W : 0;
  const int64_t fill_ctas =
      lsekb_n > 0 ? attention_math::min64(attention_math::cdiv(lsekb_n, 8 * kAuxThreads), 1024) : 0;
  const int64_t combine_ctas = pl.ns > 1 ? attention_math::cdiv(B * W * Hq, kAuxThreads / 32) : 0;
  const int64_t mass_ctas = mass ? B * Hq * pl.nkb : 0;
  const int64_t restore_ctas = p.write_back ? 0 : rows;
  constexpr int64_t kMaxGrid = INT32_MAX;
  if (fwd_grid > kMaxGrid || rows + fill_ctas > kMaxGrid ||
      combine_ctas + mass_ctas + restore_ctas > kMaxGrid)
    return cudaErrorInvalidConfiguration;
  char* ws = static_cast<char*>(workspace);
  uint16_t* saved = p.write_back ? nullptr : reinterpret_cast<uint16_t*>(ws + pl.saved);
  float* lsekb = mass ? reinterpret_cast<float*>(ws + pl.lsekb) : nullptr;
  float* part_lse = pl.ns > 1 || mass ? reinterpret_cast<float*>(ws + pl.part_lse) : nullptr;
  float* part_o = pl.ns > 1 ? reinterpret_cast<float*>(ws + pl.part_o) : nullptr;

  cudaError_t err = cudaSuccess;
  if (fwd_grid > 0) {
    err = p.dtype == ScalarType::kBFloat16 ? launch_fwd_dispatch<BF16Tag>(nullptr, D, mass, 0, stream)
                                           : launch_fwd_dispatch<F16Tag>(nullptr, D, mass, 0, stream);
    if (err != cudaSuccess) return err;
  }

  // ---- 1. refresh prologue ----
  if (rows + fill_ctas > 0) {
    PrologueArgs pa;
    pa.k = static_cast<const uint16_t*>(p.k);
    copy3(pa.ks, p.k_stride);
    pa.v = static_cast<const uint16_t*>(p.v);
    copy3(pa.vs, p.v_stride);
    pa.k_cache = static_cast<uint16_t*>(p.k_cache);
    copy3(pa.kcs, p.k_cache_stride);
    pa.v_cache = static_cast<uint16_t*>(p.v_cache);
    copy3(pa.vcs, p.v_cache_stride);
    pa.positions = p.positions;
    pa.seq_lens = p.seq_lens;
    pa.kv = kv;
    pa.W = static_cast<int32_t>(W);
    pa.Hkv = static_cast<int32_t>(Hkv);
    pa.D = static_cast<int32_t>(D);
    pa.S = static_cast<int32_t>(S);
    pa.row_ctas = static_cast<int32_t>(rows);
    pa.saved = saved;
    pa.lsekb = lsekb;
    pa.lsekb_n = lsekb_n;
    err = launch(refresh_prologue_kernel, rows + fill_ctas, kAuxThreads, 0, stream, pa);
    if (err != cudaSuccess) return err;
  }

  // ---- 2. attention ----
  if (fwd_grid > 0) {
    FwdArgs fa;
    fa.q = static_cast<const uint16_t*>(p.q);
    copy3(fa.qs, p.q_stride);
    fa.k_cache = static_cast<const uint16_t*>(p.k_cache);
    copy3(fa.kcs, p.k_cache_stride);
    fa.v_cache = static_cast<const uint16_t*>(p.v_cache);
    copy3(fa.vcs, p.v_cache_stride);
    fa.positions = p.positions;
    fa.seq_lens = p.seq_lens;
    fa.kv = kv;
    fa.kv_num_blocks = p.kv_num_blocks;
    fa.kv_indices = p.kv_indices;
    fa.max_blocks = has_list ? static_cast<int32_t>(p.max_blocks) : 0;
    fa.B = static_cast<int32_t>(B);
    fa.W = static_cast<int32_t>(W);
    fa.Hq = static_cast<int32_t>(Hq);
    fa.Hkv = static_cast<int32_t>(Hkv);
    fa.G = static_cast<int32_t>(pl.G);
    fa.S = static_cast<int32_t>(S);
    fa.q_block = static_cast<int32_t>(attention_math::min64(p.q_block, kMaxLen));
    fa.nqb = static_cast<int32_t>(pl.nqb);
    fa.n_mt = static_cast<int32_t>(pl.n_mt);
    fa.ns = pl.ns;
    fa.walk_kv_block = static_cast<int32_t>(attention_math::min64(pl.walk_kv_block, kMaxLen));
    fa.walk_nkb = static_cast<int32_t>(pl.walk_nkb);
    fa.tiles_per_block = static_cast<int32_t>(pl.tiles_per_block);
    fa.nkb = static_cast<int32_t>(pl.nkb);
    fa.scale_log2 = p.scale * kLog2e;
    fa.out = static_cast<uint16_t*>(p.out);
    copy3(fa.os, p.out_stride);
    fa.lse = p.lse;
    fa.part_o = part_o;
    fa.part_lse = part_lse;
    fa.lsekb = lsekb;
    err = p.dtype == ScalarType::kBFloat16 ? launch_fwd_dispatch<BF16Tag>(&fa, D, mass, fwd_grid, stream)
                                           : launch_fwd_dispatch<F16Tag>(&fa, D, mass, fwd_grid, stream);
    if (err != cudaSuccess) return err;
  }

  // ---- 3. epilogue ----
  const int64_t epi_grid = combine_ctas + mass_ctas + restore_ctas;
  if (epi_grid > 0) {
    EpilogueArgs ea;
    ea.positions = p.positions;
    ea.seq_lens = p.seq_lens;
    ea.B = static_cast<int32_t>(B);
    ea.W = static_cast<int32_t>(W);
    ea.Hq = static_cast<int32_t>(Hq);
    ea.Hkv = static_cast<int32_t>(Hkv);
    ea.D = static_cast<int32_t>(D);
    ea.S = static_cast<int32_t>(S);
    ea.ns = pl.ns;
    ea.nkb = static_cast<int32_t>(pl.nkb);
    ea.combine_ctas = static_cast<int32_t>(combine_ctas);
    ea.mass_ctas = static_cast<int32_t>(mass_ctas);
    ea.part_o = part_o;
    ea.part_lse = part_lse;
    ea.lsekb = lsekb;
    ea.out = static_cast<uint16_t*>(p.out);
    copy3(ea.os, p.out_stride);
    ea.lse = p.lse;
    ea.block_mass = p.block_mass;
    ea.saved = saved;
    ea.k_cache = static_cast<uint16_t*>(p.k_cache);
    copy3(ea.kcs, p.k_cache_stride);
    ea.v_cache = static_cast<uint16_t*>(p.v_cache);
    copy3(ea.vcs, p.v_cache_stride);
    ea.kv = kv;
    err = p.dtype == ScalarType::kBFloat16
              ? launch(attention_epilogue_kernel<BF16Tag>, epi_grid, kAuxThreads, 0, stream, ea)
              : launch(attention_epilogue_kernel<F16Tag>, epi_grid, kAuxThreads, 0, stream, ea);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;  // each launch's status was checked (cudaGetLastError would also report others')
}

}  // namespace dinfer_kernels
