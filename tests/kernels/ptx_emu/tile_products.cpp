// Full tile products of the tensor-core kernels, lane by lane through the PTX model (ptx_model.h),
// with every shared-memory offset and fragment coordinate taken from the kernels' own formulas
// (dinfer_kernels/detail/mma_layout.h). The loop nests are those of attention_fwd_kernel and
// gemm_tc_kernel: the same stages, waits, barriers and fragment loops, the online softmax
// replaced by the identity (P = S) so the attention tile computes (Q K^T) V exactly.
//
// Inputs are small integers: every product and sum is exact in fp32 and every S is exact in the
// b16 type, so the emulated result must equal the fp64 matmul bit for bit.
//
// A mutation (argv) perturbs what the formulas return, or drops a wait or a barrier; the test
// asserts each one is detected. Output: one JSON object per case.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dinfer_kernels/detail/mma_layout.h"
#include "dinfer_kernels/detail/moe_experts.h"
#include "ptx_model.h"

namespace ml = dinfer_kernels::mma_layout;
using namespace ptx_emu;

namespace {

enum class Mutation {
  kNone,
  kSwapLanes,  // lanes 1 and 9 swap their ldmatrix addresses in the A-operand loads
  kWriteUnswizzled,  // cp.async writes without the swizzle, ldmatrix reads with it
  kNoSwizzle,  // neither side swizzles: still correct, but bank conflicts
  kRowOffByOne,  // the epilogue puts accumulator rows one row down
  kNoTrans,  // V loaded without .trans (attention)
  kNoWait,  // the main loop's cp.async.wait_group is left out
  kShallowWait,  // the main loop waits for one group too few
  kNoBarrier,  // the barrier that protects a buffer before its refill is left out
  kBufferOverrun,  // buffers / stages one further on: the last one lies past the allocation
};

const char* name(Mutation m) {
  switch (m) {
    case Mutation::kNone:
      return "none";
    case Mutation::kSwapLanes:
      return "swap_lanes";
    case Mutation::kWriteUnswizzled:
      return "write_unswizzled";
    case Mutation::kNoSwizzle:
      return "no_swizzle";
    case Mutation::kRowOffByOne:
      return "row_off_by_one";
    case Mutation::kNoTrans:
      return "no_trans";
    case Mutation::kNoWait:
      return "no_wait";
    case Mutation::kShallowWait:
      return "shallow_wait";
    case Mutation::kNoBarrier:
      return "no_barrier";
    case Mutation::kBufferOverrun:
      return "buffer_overrun";
  }
  return "?";
}

struct Rng {
  uint64_t s;
  int uniform(int lo, int hi) {  // [lo, hi]
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return lo + static_cast<int>(s % static_cast<uint64_t>(hi - lo + 1));
  }
};

// A row-major matrix of b16 values drawn from [lo, hi] (rows >= valid_rows hold the poison).
struct Operand {
  int rows, cols;
  std::vector<uint16_t> bits;
  std::vector<float> val;
  Operand(int r, int c, int lo, int hi, B16 t, Rng& rng, int valid_rows = -1)
      : rows(r), cols(c), bits(static_cast<size_t>(r) * c, kPoison), val(static_cast<size_t>(r) * c, 0.f) {
    if (valid_rows < 0) valid_rows = r;
    for (int i = 0; i < valid_rows * c; ++i) {
      val[i] = static_cast<float>(rng.uniform(lo, hi));
      bits[i] = float_to_b16(val[i], t);
      if (!exact_b16(val[i], t)) std::abort();  // the inputs must be exact in the b16 type
    }
  }
  const uint16_t* at(int r, int c) const { return &bits[static_cast<size_t>(r) * cols + c]; }
};

// The mutation hooks act on the offsets the kernels' formulas return. Tile bases are whole
// multiples of 8 rows, so an offset's row % 8 is its row in the tile % 8.
struct Hooks {
  Mutation m;
  static long unswizzle(long off, int row_elems) {
    const long row = off / row_elems, pos = (off % row_elems) / ml::kChunkElems;
    return row * row_elems + (pos ^ (row & 7)) * ml::kChunkElems;
  }
  long write(long off, int row_elems) const {
    return m == Mutation::kWriteUnswizzled || m == Mutation::kNoSwizzle ? unswizzle(off, row_elems) : off;
  }
  long read(long off, int row_elems) const {
    return m == Mutation::kNoSwizzle ? unswizzle(off, row_elems) : off;
  }
  void a_operand(long (&addr)[32]) const {
    if (m == Mutation::kSwapLanes) std::swap(addr[1], addr[9]);
  }
  int row_shift() const { return m == Mutation::kRowOffByOne ? 1 : 0; }
  bool trans() const { return m != Mutation::kNoTrans; }
  bool wait() const { return m != Mutation::kNoWait; }
  int wait_extra() const { return m == Mutation::kShallowWait ? 1 : 0; }
  bool barrier() const { return m != Mutation::kNoBarrier; }
  int buffer(int b) const { return m == Mutation::kBufferOverrun ? b + 1 : b; }
};

// What a case found: the output against the fp64 reference, hazards, bank wavefronts.
struct Report {
  long mismatches = 0, unwritten = 0, multi_written = 0, out_of_tile = 0;
  long inexact = 0;  // P values the b16 type cannot hold (the exactness argument would not apply)
  double max_abs_err = 0;
  Hazards hz;
  Banks ld, cp;
};

// Output matrix that counts how often each element is written.
struct Out {
  int rows, cols;
  std::vector<float> v;
  std::vector<int> n;
  long out_of_tile = 0;
  Out(int r, int c)
      : rows(r), cols(c), v(static_cast<size_t>(r) * c, NAN), n(static_cast<size_t>(r) * c, 0) {}
  void put(int r, int c, float x) {
    if (r < 0 || r >= rows || c < 0 || c >= cols) {
      ++out_of_tile;
      return;
    }
    v[static_cast<size_t>(r) * cols + c] = x;
    ++n[static_cast<size_t>(r) * cols + c];
  }
  void compare(const std::vector<double>& ref, Report& rep) const {
    for (size_t i = 0; i < v.size(); ++i) {
      if (n[i] == 0) ++rep.unwritten;
      if (n[i] > 1) ++rep.multi_written;
      const double e = std::fabs(static_cast<double>(v[i]) - ref[i]);
      if (!(e == 0)) ++rep.mismatches;
      if (e > rep.max_abs_err || std::isnan(e)) rep.max_abs_err = std::isnan(e) ? INFINITY : e;
    }
    rep.out_of_tile = out_of_tile;
  }
};

using Frag = float[32][4];

// ---- attention_fwd_kernel: a partial Q tile x 3 K/V tiles (the last one partial) -----------------
template <int kD>
Report attention(B16 t, Hooks h, uint64_t seed) {
  using T = ml::AttentionTiles<kD>;
  constexpr int M = T::kTileM, N = T::kTileN, kTiles = 3, kLastKeys = 37, kRows = 45;  // rows < M
  constexpr int keys = (kTiles - 1) * N + kLastKeys;
  Rng rng{seed};
  // |S| <= 2 * 1 * kD <= 256 is exact in bf16; |O| <= 256 * 8 * keys is exact in fp32.
  const Operand q(M, kD, -2, 2, t, rng, kRows), k(kTiles * N, kD, -1, 1, t, rng, keys),
      v(kTiles * N, kD, -8, 8, t, rng, keys);

  Report rep;
  Cta cta(T::kThreads, T::kSmemElems);  // the kernel's allocation: any access past it is flagged
  const long sq = 0, sk = T::kKBase, sv = T::kVBase;
  auto load_kv = [&](int buf, int tile) {
    const int n = std::min(N, keys - tile * N);
    for (int tid = 0; tid < T::kThreads; ++tid)
      for (int i = 0; i < T::kKVRounds; ++i) {
        const int r = T::copy_row(tid, i), ch = T::copy_chunk(tid, i);
        const bool ok = r < n;
        const int key = tile * N + (ok ? r : 0);
        const long off = h.write(T::copy_offset(tid, i), kD);
        cta.cp_async(tid, sk + buf * T::kBufElems + off, k.at(key, ch * 8), ok);
        cta.cp_async(tid, sv + h.buffer(buf) * T::kBufElems + off, v.at(key, ch * 8), ok);
      }
  };
  for (int tid = 0; tid < T::kThreads; ++tid)
    for (int i = 0; i < T::kQRounds; ++i)
      cta.cp_async(tid, sq + h.write(T::copy_offset(tid, i), kD),
                   q.at(T::copy_row(tid, i), T::copy_chunk(tid, i) * 8), T::copy_row(tid, i) < kRows);
  load_kv(0, 0);
  for (int tid = 0; tid < T::kThreads; ++tid) cta.commit(tid);
  cta.count_copy_banks(rep.cp);

  constexpr int kWarps = T::kThreads / 32;
  std::vector<Frag> o(static_cast<size_t>(kWarps * T::kDT));  // o[kWarps * dt + warp]
  for (auto& f : o)
    for (auto& l : f)
      for (float& x : l) x = 0.f;
  int buf = 0;
  for (int tile = 0; tile < kTiles; ++tile) {
    const bool nxt = tile + 1 < kTiles;
    if (nxt) load_kv(buf ^ 1, tile + 1);
    for (int tid = 0; tid < T::kThreads; ++tid) {
      if (nxt) cta.commit(tid);
      if (h.wait()) cta.wait_group(tid, (nxt ? 1 : 0) + h.wait_extra());
    }
    cta.count_copy_banks(rep.cp);
    cta.barrier();
    const long kt = sk + buf * T::kBufElems, vt = sv + h.buffer(buf) * T::kBufElems;
    for (int w = 0; w < T::kThreads / 32; ++w) {
      Frag s[2 * T::kKeyChunks];  // key n8 tiles
      for (auto& f : s)
        for (auto& l : f)
          for (float& x : l) x = 0.f;
      long addr[32];
      for (int kk = 0; kk < T::kKSteps; ++kk) {
        uint32_t qa[32][4];
        for (int l = 0; l < 32; ++l) addr[l] = sq + h.read(T::q_frag(w, l, kk), kD);
        h.a_operand(addr);
        ldmatrix(cta, 32 * w, 4, false, addr, qa, &rep.ld);
        for (int np = 0; np < T::kKeyChunks; ++np) {
          uint32_t kf[32][4], b0[32][2], b1[32][2];
          for (int l = 0; l < 32; ++l) addr[l] = kt + h.read(T::k_frag(l, kk, np), kD);
          ldmatrix(cta, 32 * w, 4, false, addr, kf, &rep.ld);
          for (int l = 0; l < 32; ++l) {
            b0[l][0] = kf[l][0], b0[l][1] = kf[l][1];
            b1[l][0] = kf[l][2], b1[l][1] = kf[l][3];
          }
          mma_m16n8k16(t, s[2 * np], qa, b0);
          mma_m16n8k16(t, s[2 * np + 1], qa, b1);
        }
      }
      for (int kc = 0; kc < T::kKeyChunks; ++kc) {
        uint32_t pa[32][4];
        for (int l = 0; l < 32; ++l)
          for (int j = 0; j < 4; ++j) {
            const float lo = s[T::p_tile(kc, j)][l][T::p_reg(j, 0)],
                        hi = s[T::p_tile(kc, j)][l][T::p_reg(j, 1)];
            rep.inexact += !exact_b16(lo, t) + !exact_b16(hi, t);
            pa[l][j] = pack(float_to_b16(lo, t), float_to_b16(hi, t));
          }
        for (int dp = 0; dp < T::kKSteps; ++dp) {
          uint32_t vf[32][4], b0[32][2], b1[32][2];
          for (int l = 0; l < 32; ++l) addr[l] = vt + h.read(T::v_frag(l, kc, dp), kD);
          ldmatrix(cta, 32 * w, 4, h.trans(), addr, vf, &rep.ld);
          for (int l = 0; l < 32; ++l) {
            b0[l][0] = vf[l][0], b0[l][1] = vf[l][1];
            b1[l][0] = vf[l][2], b1[l][1] = vf[l][3];
          }
          mma_m16n8k16(t, o[kWarps * (2 * dp) + w], pa, b0);
          mma_m16n8k16(t, o[kWarps * (2 * dp + 1) + w], pa, b1);
        }
      }
    }
    if (h.barrier()) cta.barrier();
    buf ^= 1;
  }
  for (int tid = 0; tid < T::kThreads; ++tid) cta.wait_group(tid, 0);
  cta.finish();

  // The kernel's epilogue: row half r of each lane, two adjacent columns per n8 tile.
  Out out(M, kD);
  for (int w = 0; w < kWarps; ++w)
    for (int l = 0; l < 32; ++l)
      for (int r = 0; r < 2; ++r)
        for (int dt = 0; dt < T::kDT; ++dt) {
          const int row = T::acc_row(w, l, 2 * r) + h.row_shift(), col = T::acc_col(l, dt, 2 * r);
          out.put(row, col, o[kWarps * dt + w][l][2 * r]);
          out.put(row, col + 1, o[kWarps * dt + w][l][2 * r + 1]);
        }
  std::vector<double> ref(static_cast<size_t>(M) * kD, 0.0);
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < keys; ++j) {
      double sij = 0;
      for (int d = 0; d < kD; ++d) sij += static_cast<double>(q.val[i * kD + d]) * k.val[j * kD + d];
      for (int d = 0; d < kD; ++d) ref[i * kD + d] += sij * v.val[j * kD + d];
    }
  out.compare(ref, rep);
  rep.hz = cta.hz;
  return rep;
}

// ---- gemm_tc_kernel: one CTA tile over K = ktiles * BK - 24 (a partial last stage) ---------------
template <class Cfg, bool GLU>
Report gemm(B16 t, Hooks h, uint64_t seed) {
  using T = ml::GemmTiles<Cfg, GLU>;
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, STAGES = Cfg::kStages;
  constexpr int ktiles = STAGES + 2, K = ktiles * BK - 24;
  Rng rng{seed};
  // |sum| <= 64 * K < 2^24: exact in fp32.
  const Operand a(BM, K, -8, 8, t, rng), w(T::BROWS, K, -8, 8, t, rng);  // w: the stage's weight rows

  Report rep;
  Cta cta(T::kThreads, T::kSmemElems);  // the kernel's allocation: any access past it is flagged
  auto load_stage = [&](int stage, int kt) {
    for (int tid = 0; tid < T::kThreads; ++tid) {
      const int k = kt * BK + T::load_chunk(tid) * 8;
      const bool kin = k < K;
      const long s = static_cast<long>(h.buffer(stage)) * T::STAGE_ELEMS;
      for (int i = 0; i < T::A_ITERS; ++i)
        cta.cp_async(tid, s + h.write(T::load_offset(tid, i), BK),
                     kin ? a.at(T::load_row(tid, i), k) : nullptr, kin);
      for (int i = 0; i < T::B_ITERS; ++i)
        cta.cp_async(tid, s + T::A_ELEMS + h.write(T::load_offset(tid, i), BK),
                     kin ? w.at(T::load_row(tid, i), k) : nullptr, kin);
    }
  };
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    for (int tid = 0; tid < T::kThreads; ++tid) cta.commit(tid);
  }
  cta.count_copy_banks(rep.cp);

  constexpr int kWarps = T::kThreads / 32;
  std::vector<Frag> acc(static_cast<size_t>(kWarps * T::MI * T::NT));  // [warp][mi][nt]
  for (auto& f : acc)
    for (auto& l : f)
      for (float& x : l) x = 0.f;
  for (int kt = 0; kt < ktiles; ++kt) {
    for (int tid = 0; tid < T::kThreads; ++tid)
      if (h.wait()) cta.wait_group(tid, STAGES - 2 + h.wait_extra());
    if (h.barrier()) cta.barrier();
    if (kt + STAGES - 1 < ktiles) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
    for (int tid = 0; tid < T::kThreads; ++tid) cta.commit(tid);
    cta.count_copy_banks(rep.cp);
    const long sa = static_cast<long>(h.buffer(kt % STAGES)) * T::STAGE_ELEMS, sb = sa + T::A_ELEMS;
    for (int wp = 0; wp < kWarps; ++wp) {
      const int wm = T::warp_m(wp), wn = T::warp_n(wp);
      long addr[32];
      for (int ks = 0; ks < BK / 16; ++ks) {
        uint32_t bf[T::NT][32][2];
        for (int p = 0; p < T::NT / 2; ++p) {
          uint32_t r[32][4];
          for (int l = 0; l < 32; ++l) addr[l] = sb + h.read(T::b_frag(wn, l, ks, p), BK);
          ldmatrix(cta, 32 * wp, 4, false, addr, r, &rep.ld);
          for (int l = 0; l < 32; ++l) {
            bf[2 * p][l][0] = r[l][0], bf[2 * p][l][1] = r[l][1];
            bf[2 * p + 1][l][0] = r[l][2], bf[2 * p + 1][l][1] = r[l][3];
          }
        }
        for (int mi = 0; mi < T::MI; ++mi) {
          uint32_t af[32][4];
          for (int l = 0; l < 32; ++l) addr[l] = sa + h.read(T::a_frag(wm, l, ks, mi), BK);
          h.a_operand(addr);
          ldmatrix(cta, 32 * wp, 4, false, addr, af, &rep.ld);
          for (int nt = 0; nt < T::NT; ++nt) mma_m16n8k16(t, acc[(wp * T::MI + mi) * T::NT + nt], af, bf[nt]);
        }
      }
    }
  }
  for (int tid = 0; tid < T::kThreads; ++tid) cta.wait_group(tid, 0);
  cta.finish();

  // The kernel's epilogue: gate fragments j and up fragments NI + j give output columns j * 8 + ...
  Out out(BM, T::BROWS);  // columns [0, BN): gate (or down), [BN, 2 BN): up
  for (int wp = 0; wp < kWarps; ++wp)
    for (int l = 0; l < 32; ++l)
      for (int mi = 0; mi < T::MI; ++mi)
        for (int half = 0; half < 2; ++half)
          for (int j = 0; j < T::NI; ++j) {
            const int wm = T::warp_m(wp), wn = T::warp_n(wp);
            const int r = T::acc_row(wm, l, mi, 2 * half) + h.row_shift(),
                      col = T::acc_col(wn, l, j, 2 * half);
            for (int part = 0; part < (GLU ? 2 : 1); ++part) {
              const float* cv = acc[(wp * T::MI + mi) * T::NT + part * T::NI + j][l] + half * 2;
              out.put(r, part * BN + col, cv[0]);
              out.put(r, part * BN + col + 1, cv[1]);
            }
          }
  std::vector<double> ref(static_cast<size_t>(BM) * T::BROWS, 0.0);
  for (int i = 0; i < BM; ++i)
    for (int n = 0; n < T::BROWS; ++n) {
      double s = 0;
      for (int kk = 0; kk < K; ++kk)
        s += static_cast<double>(a.val[static_cast<size_t>(i) * K + kk]) *
             w.val[static_cast<size_t>(n) * K + kk];
      ref[static_cast<size_t>(i) * T::BROWS + n] = s;
    }
  out.compare(ref, rep);
  rep.hz = cta.hz;
  return rep;
}

// ---- gemm_tc_kernel with FP8 weights: e4m3 bytes staged, converted by their copier into the b16 tile --
// e4m3fn bits of a small integer |v| <= 15 (exact: 3 mantissa bits), independent of the kernels' decoder.
uint8_t e4m3_of(int v) {
  const int a = v < 0 ? -v : v;
  int bits = 0;
  if (a > 0) {
    int e = 0;
    while ((2 << e) <= a) ++e;
    bits = ((e + 7) << 3) | ((a - (1 << e)) * 8 >> e);
  }
  return static_cast<uint8_t>(bits | (v < 0 ? 0x80 : 0));
}

template <class Cfg, bool GLU>
Report gemm_fp8(B16 t, Hooks h, uint64_t seed) {
  using T = ml::GemmTiles<Cfg, GLU>;
  using T8 = ml::Fp8Tiles<Cfg, GLU>;
  constexpr int BM = T::BM, BN = T::BN, BK = T::BK, STAGES = Cfg::kStages, BROWS = T::BROWS;
  constexpr int ktiles = STAGES + 2, K = ktiles * BK - 32;  // a partial last stage of whole 16-byte chunks
  constexpr int kBlocks = (K + 127) / 128;
  Rng rng{seed};
  const Operand a(BM, K, -8, 8, t, rng);
  // Weights: small integers as e4m3 bytes, a power-of-two scale per 128 x 128 block of the tile: every
  // dequantised weight and every sum stays exact (|sum| <= 8 * 32 * K < 2^24).
  std::vector<uint8_t> q(static_cast<size_t>(BROWS) * K);
  std::vector<float> scale(static_cast<size_t>((BROWS + 127) / 128) * kBlocks), wval(q.size());
  for (float& s : scale) s = std::ldexp(1.f, rng.uniform(-2, 2));
  for (size_t i = 0; i < q.size(); ++i) {
    const int v = rng.uniform(-8, 8), r = static_cast<int>(i / K), k = static_cast<int>(i % K);
    q[i] = e4m3_of(v);
    wval[i] = static_cast<float>(v) * scale[(r / 128) * kBlocks + k / 128];
  }
  auto scale_of = [&](int r, int k) { return scale[(r / 128) * kBlocks + k / 128]; };

  Report rep;
  Cta cta(T::kThreads, T8::kSmemElems);  // the kernel's allocation: any access past it is flagged
  auto load_stage = [&](int stage, int kt) {
    const long s = static_cast<long>(h.buffer(stage)) * T8::STAGE_ELEMS;
    for (int tid = 0; tid < T::kThreads; ++tid) {
      const int k = kt * BK + T::load_chunk(tid) * 8;
      for (int i = 0; i < T::A_ITERS; ++i)
        cta.cp_async(tid, s + h.write(T::load_offset(tid, i), BK),
                     k < K ? a.at(T::load_row(tid, i), k) : nullptr, k < K);
      const int k8 = kt * BK + T8::load_chunk(tid) * T8::kChunk;
      for (int i = 0; i < T8::B_ITERS; ++i) {  // the staged bytes, 8 b16 elements per chunk
        const uint8_t* src = k8 < K ? &q[static_cast<size_t>(T8::load_row(tid, i)) * K + k8] : nullptr;
        cta.cp_async(tid, s + T::A_ELEMS + T8::staged_offset(tid, i) / 2,
                     reinterpret_cast<const uint16_t*>(src), k8 < K);
      }
    }
  };
  auto convert_stage = [&](int stage, int kt) {
    const long s = static_cast<long>(h.buffer(stage)) * T8::STAGE_ELEMS;
    for (int tid = 0; tid < T::kThreads; ++tid) {
      const int k8 = kt * BK + T8::load_chunk(tid) * T8::kChunk;
      for (int i = 0; i < T8::B_ITERS; ++i) {
        const uint16_t* staged = cta.read_row(tid, s + T::A_ELEMS + T8::staged_offset(tid, i) / 2);
        if (staged == nullptr) continue;
        uint8_t bytes[16];
        std::memcpy(bytes, staged, 16);
        const float sc = k8 < K ? scale_of(T8::load_row(tid, i), k8) : 0.f;
        for (int half = 0; half < 2; ++half) {
          uint16_t out[8];
          for (int j = 0; j < 8; ++j)
            out[j] = float_to_b16(dinfer_kernels::moe_experts::fp8_dequant(bytes[8 * half + j], sc), t);
          cta.store_row(tid, T8::CONV_AT + h.write(T8::conv_offset(tid, i, half), BK), out);
        }
      }
    }
  };
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    for (int tid = 0; tid < T::kThreads; ++tid) cta.commit(tid);
  }
  cta.count_copy_banks(rep.cp);

  constexpr int kWarps = T::kThreads / 32;
  std::vector<Frag> acc(static_cast<size_t>(kWarps * T::MI * T::NT));  // [warp][mi][nt]
  for (auto& f : acc)
    for (auto& l : f)
      for (float& x : l) x = 0.f;
  for (int kt = 0; kt < ktiles; ++kt) {
    for (int tid = 0; tid < T::kThreads; ++tid)
      if (h.wait()) cta.wait_group(tid, STAGES - 2 + h.wait_extra());
    if (h.barrier()) cta.barrier();
    convert_stage(kt % STAGES, kt);
    if (kt + STAGES - 1 < ktiles) load_stage((kt + STAGES - 1) % STAGES, kt + STAGES - 1);
    for (int tid = 0; tid < T::kThreads; ++tid) cta.commit(tid);
    cta.count_copy_banks(rep.cp);
    if (h.barrier()) cta.barrier();  // the converted tile is complete
    const long sa = static_cast<long>(h.buffer(kt % STAGES)) * T8::STAGE_ELEMS, sb = T8::CONV_AT;
    for (int wp = 0; wp < kWarps; ++wp) {
      const int wm = T::warp_m(wp), wn = T::warp_n(wp);
      long addr[32];
      for (int ks = 0; ks < BK / 16; ++ks) {
        uint32_t bf[T::NT][32][2];
        for (int p = 0; p < T::NT / 2; ++p) {
          uint32_t r[32][4];
          for (int l = 0; l < 32; ++l) addr[l] = sb + h.read(T::b_frag(wn, l, ks, p), BK);
          ldmatrix(cta, 32 * wp, 4, false, addr, r, &rep.ld);
          for (int l = 0; l < 32; ++l) {
            bf[2 * p][l][0] = r[l][0], bf[2 * p][l][1] = r[l][1];
            bf[2 * p + 1][l][0] = r[l][2], bf[2 * p + 1][l][1] = r[l][3];
          }
        }
        for (int mi = 0; mi < T::MI; ++mi) {
          uint32_t af[32][4];
          for (int l = 0; l < 32; ++l) addr[l] = sa + h.read(T::a_frag(wm, l, ks, mi), BK);
          h.a_operand(addr);
          ldmatrix(cta, 32 * wp, 4, false, addr, af, &rep.ld);
          for (int nt = 0; nt < T::NT; ++nt) mma_m16n8k16(t, acc[(wp * T::MI + mi) * T::NT + nt], af, bf[nt]);
        }
      }
    }
  }
  for (int tid = 0; tid < T::kThreads; ++tid) cta.wait_group(tid, 0);
  cta.finish();

  Out out(BM, BROWS);  // columns [0, BN): gate (or down), [BN, 2 BN): up
  for (int wp = 0; wp < kWarps; ++wp)
    for (int l = 0; l < 32; ++l)
      for (int mi = 0; mi < T::MI; ++mi)
        for (int half = 0; half < 2; ++half)
          for (int j = 0; j < T::NI; ++j) {
            const int wm = T::warp_m(wp), wn = T::warp_n(wp);
            const int r = T::acc_row(wm, l, mi, 2 * half) + h.row_shift(),
                      col = T::acc_col(wn, l, j, 2 * half);
            for (int part = 0; part < (GLU ? 2 : 1); ++part) {
              const float* cv = acc[(wp * T::MI + mi) * T::NT + part * T::NI + j][l] + half * 2;
              out.put(r, part * BN + col, cv[0]);
              out.put(r, part * BN + col + 1, cv[1]);
            }
          }
  std::vector<double> ref(static_cast<size_t>(BM) * BROWS, 0.0);
  for (int i = 0; i < BM; ++i)
    for (int n = 0; n < BROWS; ++n) {
      double sum = 0;
      for (int kk = 0; kk < K; ++kk)
        sum += static_cast<double>(a.val[static_cast<size_t>(i) * K + kk]) *
               wval[static_cast<size_t>(n) * K + kk];
      ref[static_cast<size_t>(i) * BROWS + n] = sum;
    }
  out.compare(ref, rep);
  rep.hz = cta.hz;
  return rep;
}

// ---- checks of the PTX model itself ----------------------------------------------------------------
// The fragment tables cover each matrix element exactly once; .x1 / .x2 give the first registers
// of .x4; .trans of a stored transpose gives the plain load.
long model_self_check() {
  long bad = 0;
  int na[16][16] = {}, nb[16][8] = {}, nc[16][8] = {};
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < 8; ++i) ++na[a_elem_row(l, i)][a_elem_col(l, i)];
    for (int i = 0; i < 4; ++i)
      ++nb[b_elem_row(l, i)][b_elem_col(l, i)], ++nc[c_elem_row(l, i)][c_elem_col(l, i)];
  }
  for (auto& r : na)
    for (int x : r) bad += x != 1;
  for (auto& r : nb)
    for (int x : r) bad += x != 1;
  for (auto& r : nc)
    for (int x : r) bad += x != 1;

  Cta cta(32, 2 * 4 * 64);  // matrices 0-3 (8 x 8 each) at [0, 256), their transposes after
  for (int tid = 0; tid < 32; ++tid) {
    uint16_t row[8], col[8];
    for (int c = 0; c < 8; ++c) {
      row[c] = static_cast<uint16_t>(tid * 8 + c);  // M_q[r][c], q = tid / 8, r = tid % 8
      col[c] = static_cast<uint16_t>((tid / 8) * 64 + c * 8 + tid % 8);  // M_q[c][r]
    }
    cta.cp_async(tid, tid * 8, row, true);
    cta.cp_async(tid, 256 + tid * 8, col, true);
    cta.commit(tid);
    cta.wait_group(tid, 0);
  }
  cta.barrier();
  long plain[32], tr[32];
  for (int l = 0; l < 32; ++l) plain[l] = l * 8, tr[l] = 256 + l * 8;
  uint32_t x4[32][4], x2[32][4], x1[32][4], t4[32][4];
  ldmatrix(cta, 0, 4, false, plain, x4, nullptr);
  ldmatrix(cta, 0, 2, false, plain, x2, nullptr);
  ldmatrix(cta, 0, 1, false, plain, x1, nullptr);
  ldmatrix(cta, 0, 4, true, tr, t4, nullptr);
  for (int l = 0; l < 32; ++l) {
    for (int q = 0; q < 4; ++q) {
      bad += t4[l][q] != x4[l][q];
      // lane l, register q: M_q[l / 4][2 (l % 4)], the element numbered q * 64 + row * 8 + col
      bad += lo16(x4[l][q]) != q * 64 + (l / 4) * 8 + 2 * (l % 4);
      bad += hi16(x4[l][q]) != q * 64 + (l / 4) * 8 + 2 * (l % 4) + 1;
    }
    bad += x2[l][0] != x4[l][0] || x2[l][1] != x4[l][1] || x1[l][0] != x4[l][0];
  }
  bad += cta.hz.total();
  return bad;
}

void print(const char* kernel, const char* config, B16 t, Mutation m, const Report& r) {
  std::printf(
      "{\"kernel\": \"%s\", \"config\": \"%s\", \"dtype\": \"%s\", \"mutation\": \"%s\", "
      "\"mismatches\": %ld, \"inexact\": %ld, \"max_abs_err\": %g, \"unwritten\": %ld, \"multi_written\": "
      "%ld, "
      "\"out_of_tile\": %ld, \"inflight_read\": %ld, \"unsynced_read\": %ld, \"war\": %ld, "
      "\"double_copy\": %ld, \"bad_address\": %ld, \"exit_inflight\": %ld, "
      "\"ldmatrix_phases\": %ld, \"ldmatrix_wavefronts\": %ld, \"cp_async_phases\": %ld, "
      "\"cp_async_wavefronts\": %ld}\n",
      kernel, config, t == B16::kBF16 ? "bf16" : "fp16", name(m), r.mismatches, r.inexact,
      std::isinf(r.max_abs_err) ? 1e300 : r.max_abs_err, r.unwritten, r.multi_written, r.out_of_tile,
      r.hz.inflight_read, r.hz.unsynced_read, r.hz.war, r.hz.double_copy, r.hz.bad_address,
      r.hz.exit_inflight, r.ld.phases, r.ld.wavefronts, r.cp.phases, r.cp.wavefronts);
}

}  // namespace

int main() {
  std::printf("{\"kernel\": \"model\", \"self_check_failures\": %ld}\n", model_self_check());
  const Mutation common[] = {Mutation::kNone,        Mutation::kSwapLanes,   Mutation::kWriteUnswizzled,
                             Mutation::kNoSwizzle,   Mutation::kRowOffByOne, Mutation::kNoWait,
                             Mutation::kShallowWait, Mutation::kNoBarrier,   Mutation::kBufferOverrun};
  uint64_t seed = 0x9E3779B97F4A7C15ull;
  for (B16 t : {B16::kBF16, B16::kF16}) {
    for (Mutation m : common) {
      print("attention", "D64", t, m, attention<64>(t, Hooks{m}, ++seed));
      print("attention", "D128", t, m, attention<128>(t, Hooks{m}, ++seed));
      print("moe", "SmallGemm1", t, m, gemm<ml::SmallGemm1, true>(t, Hooks{m}, ++seed));
      print("moe", "SmallGemm2", t, m, gemm<ml::SmallGemm2, false>(t, Hooks{m}, ++seed));
      print("moe", "LargeGemm1", t, m, gemm<ml::LargeGemm1, true>(t, Hooks{m}, ++seed));
      print("moe", "LargeGemm2", t, m, gemm<ml::LargeGemm2, false>(t, Hooks{m}, ++seed));
      print("moe", "SmallGemm1Fp8", t, m, gemm_fp8<ml::SmallGemm1, true>(t, Hooks{m}, ++seed));
      print("moe", "SmallGemm2Fp8", t, m, gemm_fp8<ml::SmallGemm2, false>(t, Hooks{m}, ++seed));
      print("moe", "LargeGemm1Fp8", t, m, gemm_fp8<ml::LargeGemm1, true>(t, Hooks{m}, ++seed));
      print("moe", "LargeGemm2Fp8", t, m, gemm_fp8<ml::LargeGemm2, false>(t, Hooks{m}, ++seed));
    }
    print("attention", "D64", t, Mutation::kNoTrans, attention<64>(t, Hooks{Mutation::kNoTrans}, ++seed));
    print("attention", "D128", t, Mutation::kNoTrans, attention<128>(t, Hooks{Mutation::kNoTrans}, ++seed));
  }
  return 0;
}
