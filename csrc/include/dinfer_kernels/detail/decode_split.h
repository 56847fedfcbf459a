// The vocabulary pass of the CUDA decode step (decode.cu), per thread and per CTA, its rows' merge by
// their last CTA, and the per-sequence phases of its finalize kernel, as __host__ __device__ code: the
// kernels call these functions, and tests/kernels/device_logic/ runs them on the host, with the
// kernels' own unit walk, thread striding, reduction trees and barriers (the finalize CTA through the
// SIMT emulator), in several CTA orders (only the hardware exp2/log2 differ there, scalar.h).
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dinfer_kernels/decode.h"
#include "dinfer_kernels/detail/decode_math.h"
#include "dinfer_kernels/detail/dtype_tags.h"
#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/detail/simt.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace decode_split {

using decode_math::kNoIndex;
using decode_math::Partial;

constexpr int kSplitThreads = 256;
// 16-byte loads in flight per thread. The persistent split kernel takes 48-64 registers (sm_90a): 4-5
// CTAs per SM, so 64-80 KB are in flight per SM, well above what HBM latency x bandwidth needs
// (~30 KB). Asking the launch bounds for 5 CTAs spills.
constexpr int kUnroll = 4;
constexpr int kFinalizeThreads = 256;
// A row's last CTA stages one split's partial per thread.
constexpr int kMaxSplits = kDecodeStepMaxSplits;
static_assert(kMaxSplits <= kSplitThreads, "one thread per split");
constexpr int kStageRows = 1024;  // rows per sequence staged in shared memory (24 KB)
// Element indices are int32 (Partial stores them so); the margin keeps `v += blockDim` from wrapping.
constexpr int64_t kMaxVocab = int64_t{1} << 30;

// ---- element formats -----------------------------------------------------------------------------

// One 16-byte load: CUDA's uint4, or the same four words on the host.
#if defined(__CUDACC__)
using Load16 = uint4;
#else
struct Load16 {
  uint32_t x, y, z, w;
};
#endif

using dtype::BF16Tag;
using dtype::F16Tag;
using dtype::F32Tag;
using dtype::to_float;
using scalar::bits_to_float;
using scalar::fast_exp2;
using scalar::fast_log2;
using scalar::kLn2;
using scalar::kLog2e;

DINFER_HD void unpack(const Load16& q, float (&z)[4], F32Tag) {
  z[0] = bits_to_float(q.x);
  z[1] = bits_to_float(q.y);
  z[2] = bits_to_float(q.z);
  z[3] = bits_to_float(q.w);
}

DINFER_HD void unpack(const Load16& q, float (&z)[8], BF16Tag) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  DINFER_UNROLL
  for (int k = 0; k < 4; ++k) {  // little endian: the lower half-word is the lower index
    z[2 * k] = bits_to_float(w[k] << 16);
    z[2 * k + 1] = bits_to_float(w[k] & 0xFFFF0000u);
  }
}

DINFER_HD void unpack(const Load16& q, float (&z)[8], F16Tag) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  DINFER_UNROLL
  for (int k = 0; k < 4; ++k) {
    z[2 * k] = to_float(static_cast<uint16_t>(w[k] & 0xFFFFu), F16Tag{});
    z[2 * k + 1] = to_float(static_cast<uint16_t>(w[k] >> 16), F16Tag{});
  }
}

// ---- hot-loop primitives -------------------------------------------------------------------------

// The logits are read exactly once: keep them out of L1 and let L2 fetch whole 256-byte sectors.
DINFER_HD Load16 load_stream(const Load16* p) {
#if defined(__CUDA_ARCH__)
  Load16 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
#else
  Load16 r;
  memcpy(&r, p, sizeof r);
  return r;
#endif
}

// exp(z - ms) for z <= ms (ms finite, or 0 while nothing finite was seen). The terms that dominate
// the sum have z close to ms, where z - ms is exact (Sterbenz) and the product is off by <= 0.5 ulp
// of a small argument: the sum stays within ~2 ulp of an expf-based one. MUFU.EX2 alone, because
// expf would cost ~8 instructions per element and the budget at full HBM rate is ~14 in total.
DINFER_HD float exp_shifted(float z, float ms) { return fast_exp2((z - ms) * kLog2e); }

// ---- per-thread scan -----------------------------------------------------------------------------

struct ScanCtx {
  int32_t mask_id;  // -1 when outside [0, V): no element is excluded
  float temperature;
  float inv_t;  // only for the prune bound; scores divide by temperature like the reference
  uint32_t key;  // decode_math::row_key of the row
};

// Upper bound of decode_math::gumbel(key, v) from the hash h = mix32(key ^ v) alone:
// g = -log(-log u) <= -log(1 - u) with u = (k + 0.5) / 2^23, k = h >> 9 (exact in fp32). With
// j = 2^23 - 1 - k, 1 - u = (j + 0.5) / 2^23 >= j / 2^23, so g <= 23 ln2 - ln j. Built from bits
// instead of I2F: 2^23 + j is exact in fp32, so subtracting 2^23 leaves jf = j exactly.
// jf == 0 gives +inf (never pruned).
DINFER_HD float gumbel_upper_bound(uint32_t h) {
  const float jf = bits_to_float((h >> 9) ^ 0x4B7FFFFFu) - 8388608.0f;
  return fmaf(fast_log2(jf), -kLn2, 23.0f * kLn2);
}

// A candidate whose computed bound is below this cannot beat `best`. The margin (2^-16 relative +
// 1e-3 absolute) dwarfs the errors of the bound (<= ~3 ulp of the score, lg2.approx ~1e-6, logf's
// ~1 ulp inside gumbel): pruning never changes a result, it only skips exact evaluations.
DINFER_HD float prune_threshold(float best) {
  if (best == INFINITY) return INFINITY;  // later indices cannot beat +inf (ties go to the lower)
  return best - (fabsf(best) * 0x1p-16f + 1e-3f);
}

// What one thread knows about its elements, visited in increasing index order (so a strict `>` is
// the lowest-index-wins rule). The sum is of exp(z - ms); ms == m once m is finite.
template <bool kSample>
struct ScanState {
  float m = -INFINITY, ms = 0.f, sum = 0.f;
  int32_t arg = kNoIndex;
  // Best score over v != mask_id (score = z at T == 0; then the all-token best is m/arg).
  float nmv = -INFINITY;
  int32_t nmi = kNoIndex;
  // kSample only: the mask token's score (scored apart so the loop needs no per-element test).
  float maskv = -INFINITY;
  int32_t maski = kNoIndex;
  float thr = -INFINITY;
  // Smallest raw element, with NaN and +inf counted as -inf: -inf iff the thread saw a non-finite
  // logit. One fminf per element in the fast path; NaN takes the sum's NaN branch, +inf the slow path.
  float zmin = INFINITY;

  DINFER_HD void raise_max(float z, int32_t v) {  // z > m
    sum = decode_math::rescale(sum, m, z);
    m = ms = z;
    arg = v;
  }

  // Exact score update for sampling; beats() so that -inf scores still record the lowest index:
  // a live row then always has a candidate index, even if every score overflowed to -inf.
  DINFER_HD void offer_score(float z, int32_t v, const ScanCtx& c) {
    const float s = decode_math::score_of(z, c.temperature, c.key, v);
    if (decode_math::beats(s, v, nmv, nmi)) {
      nmv = s;
      nmi = v;
      thr = prune_threshold(s);
    }
  }

  // Any element, any value: the slow path (row head/tail, vectors holding +inf or the mask token).
  DINFER_HD void scalar(float raw, int32_t v, const ScanCtx& c) {
    zmin = fminf(zmin, fabsf(raw) <= FLT_MAX ? raw : -INFINITY);
    const float z = decode_math::sanitize(raw);
    if (z > m) raise_max(z, v);
    sum += exp_shifted(z, ms);
    if (v == c.mask_id) {
      if (kSample) {
        maskv = decode_math::score_of(z, c.temperature, c.key, v);
        maski = v;
      }
    } else if (kSample) {
      offer_score(z, v, c);
    } else if (z > nmv) {
      nmv = z;
      nmi = v;
    }
  }

  // E consecutive elements starting at `base`.
  template <int E>
  DINFER_HD void vector(const float (&z)[E], int32_t base, bool has_mask, const ScanCtx& c) {
    // fmaxf drops NaN, which sanitises to -inf and so can never be a max: vmax is the sanitised
    // maximum unless an element is +inf (or every element is NaN: vmax = NaN compares false below).
    float vmax = z[0];
    DINFER_UNROLL
    for (int j = 1; j < E; ++j) vmax = fmaxf(vmax, z[j]);
    if (vmax == INFINITY || has_mask) {
      DINFER_UNROLL
      for (int j = 0; j < E; ++j) scalar(z[j], base + j, c);
      return;
    }
    // Rare after the first few vectors: a new maximum.
    if (kSample ? vmax > m : vmax > nmv) {
      int32_t j = E - 1;
      DINFER_UNROLL
      for (int k = E - 2; k >= 0; --k) j = z[k] == vmax ? k : j;
      if (!kSample) {
        nmv = vmax;
        nmi = base + j;
      }
      if (vmax > m) raise_max(vmax, base + j);  // nmv <= m, so at T == 0 this nests
    }
    float e[E];
    DINFER_UNROLL
    for (int j = 0; j < E; ++j) e[j] = exp_shifted(z[j], ms);
    DINFER_UNROLL
    for (int w = 1; w < E; w *= 2)  // pairwise: shorter dependency chain, smaller rounding error
      DINFER_UNROLL
    for (int j = 0; j + w < E; j += 2 * w) e[j] += e[j + w];
    float vmin = z[0];
    DINFER_UNROLL
    for (int j = 1; j < E; ++j) vmin = fminf(vmin, z[j]);
    zmin = fminf(zmin, vmin);
    if (e[0] != e[0]) {  // a NaN input: NaN -> -inf contributes exp(-inf) = 0
      zmin = -INFINITY;
      e[0] = 0.f;
      DINFER_UNROLL
      for (int j = 0; j < E; ++j) e[0] += exp_shifted(decode_math::sanitize(z[j]), ms);
    }
    sum += e[0];
    if (kSample) {
      // Scores z / T + gumbel cost a division, a hash and two logf each. Most tokens cannot win:
      // bound the score with one multiply-add and one MUFU.LG2, evaluate exactly only when the
      // bound reaches the running best (a NaN z or bound also takes the exact path).
      DINFER_UNROLL
      for (int j = 0; j < E; ++j) {
        const uint32_t v = static_cast<uint32_t>(base + j);
        const float bound = fmaf(z[j], c.inv_t, gumbel_upper_bound(decode_math::mix32(c.key ^ v)));
        if (!(bound < thr)) offer_score(decode_math::sanitize(z[j]), base + j, c);
      }
    }
  }

  DINFER_HD Partial partial() const {
    // Nothing but -inf (or no elements): merge as empty, like the CPU backend's all -inf chunks.
    Partial p = decode_math::empty_partial();
    p.nonfinite = zmin == -INFINITY ? 1 : 0;
    if (m == -INFINITY) return p;
    p.max = m;
    p.sum = sum;
    p.arg = arg;
    p.nm_score = nmv;
    p.nm_arg = nmi;
    if (kSample) {
      const bool mb = decode_math::beats(maskv, maski, nmv, nmi);
      p.score = mb ? maskv : nmv;
      p.score_arg = mb ? maski : nmi;
    } else {
      p.score = m;
      p.score_arg = arg;
    }
    return p;
  }
};

// Thread `tid` of `nt` scans elements [c0, c1) of `row`: a scalar head up to the first 16-byte
// boundary (row strides need not be multiples of the vector width), aligned vectors, a scalar tail.
// Per thread, indices increase from head to vectors to tail.
template <class Tag, bool kSample>
DINFER_HD Partial scan_chunk(const typename Tag::Raw* row, int32_t c0, int32_t c1, int tid, int nt,
                             const ScanCtx& c) {
  using Raw = typename Tag::Raw;
  constexpr int E = Tag::kVec;
  ScanState<kSample> st;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row + c0);
  const int32_t head = static_cast<int32_t>(((16u - (addr & 15u)) & 15u) / sizeof(Raw));
  const int32_t va = c1 - c0 < head ? c1 : c0 + head;
  const int32_t nvec = (c1 - va) / E;
  const int32_t ve = va + nvec * E;
  const int32_t mask_vec = c.mask_id >= va && c.mask_id < ve ? (c.mask_id - va) / E : -1;

  for (int32_t v = c0 + tid; v < va; v += nt) st.scalar(to_float(row[v], Tag{}), v, c);

  const Load16* vp = reinterpret_cast<const Load16*>(row + va);
  for (int32_t i = tid; i < nvec; i += nt * kUnroll) {
    Load16 q[kUnroll];
    DINFER_UNROLL
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll requests in flight
      const int32_t k = i + u * nt;
      q[u] = k < nvec ? load_stream(vp + k) : Load16{0u, 0u, 0u, 0u};
    }
    DINFER_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t k = i + u * nt;
      if (k < nvec) {
        float z[E];
        unpack(q[u], z, Tag{});
        st.vector(z, va + k * E, k == mask_vec, c);
      }
    }
  }

  for (int32_t v = ve + tid; v < c1; v += nt) st.scalar(to_float(row[v], Tag{}), v, c);
  return st.partial();
}

// ---- split pass: a persistent grid walking (row, vocabulary split) units --------------------------

struct SplitArgs {
  const void* logits;
  int64_t row_stride;  // elements
  int32_t vocab;
  int32_t num_splits;
  int32_t chunk;  // elements per split, a multiple of 8
  uint32_t num_units;  // N * num_splits: unit u is row u / num_splits, split u % num_splits
  int32_t mask_id;  // -1 when outside [0, V)
  float temperature;
  uint32_t seed, offset;
  const int64_t* row_keys;  // [N] or null (decode_math::row_counter)
  Partial* partials;  // [N, num_splits]
};

// The split pass's arguments for a call (V <= kMaxVocab) with num_splits splits per row. Chunks of
// whole vectors of both widths, so split boundaries never cut a vector.
inline SplitArgs split_args(const DecodeStepParams& p, int num_splits, Partial* partials) {
  SplitArgs sa;
  sa.logits = p.logits;
  sa.row_stride = p.row_stride;
  sa.vocab = static_cast<int32_t>(p.vocab);
  sa.num_splits = num_splits;
  sa.chunk = static_cast<int32_t>(((p.vocab + num_splits - 1) / num_splits + 7) / 8 * 8);
  sa.num_units = static_cast<uint32_t>(p.num_rows * num_splits);
  sa.mask_id = p.mask_id >= 0 && p.mask_id < p.vocab ? static_cast<int32_t>(p.mask_id) : -1;
  sa.temperature = p.temperature;
  sa.seed = p.seed;
  sa.offset = p.offset;
  sa.row_keys = p.row_keys;
  sa.partials = partials;
  return sa;
}

// Partial of thread `tid` for unit `u` (row u / num_splits, split u % num_splits), before the CTA's
// reduction. Which CTA runs a unit never changes its partial.
template <class Tag, bool kSample>
DINFER_HD Partial split_thread_partial(const SplitArgs& a, uint32_t u, int tid) {
  using Raw = typename Tag::Raw;
  const int64_t n = u / static_cast<uint32_t>(a.num_splits);
  const int32_t s = static_cast<int32_t>(u % static_cast<uint32_t>(a.num_splits));
  const int32_t c0 = s * a.chunk < a.vocab ? s * a.chunk : a.vocab;
  const int32_t c1 = c0 + a.chunk < a.vocab ? c0 + a.chunk : a.vocab;
  const Raw* row = static_cast<const Raw*>(a.logits) + n * a.row_stride;

  ScanCtx c;
  c.mask_id = a.mask_id;
  c.temperature = a.temperature;
  c.inv_t = 1.0f / a.temperature;
  c.key = decode_math::row_key(a.seed, a.offset, decode_math::row_counter(a.row_keys, n));
  return scan_chunk<Tag, kSample>(row, c0, c1, tid, kSplitThreads, c);
}

// The CTA reduction is a shuffle-down tree per warp (offsets 16, 8, 4, 2, 1; a lane whose source
// is past the warp keeps its own value), then warp 0 reduces the warps' results the same way, lanes
// past the warp count holding empty partials.
constexpr int kWarpSize = 32;
constexpr int kFirstShuffleOffset = kWarpSize / 2;

// ---- per-row merge: the row's last CTA ----------------------------------------------------------------

struct FinalizeArgs {
  DecodeStepParams p;
  Partial* partials;  // [N, num_splits], 16-byte aligned (workspace offset 0)
  int32_t* tickets;  // [N] units of the row done so far; zeroed before the split pass
  int64_t* fb_token;  // [N] scratch: fallback token per row
  float* fb_conf;  // [N] scratch: its probability (-inf: none)
  int32_t num_splits;
};

struct FinalizeSeq {
  int64_t lo, L;  // rows [lo, lo + L) of the batch
  bool staged;  // L <= kStageRows: phases b and c read shared memory, else the global copies
};

// x clamped to [lo, hi] (hi >= lo). The device's min / max instructions: the same clamp written with
// selects costs the finalize kernel a 16-byte spill.
DINFER_HD int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
#if defined(__CUDA_ARCH__)
  return min(max(x, lo), hi);
#else
  return x < lo ? lo : (x > hi ? hi : x);
#endif
}

// Bad offsets must not read or write out of bounds: clamp to [0, N] with hi >= lo.
DINFER_HD FinalizeSeq finalize_seq(const FinalizeArgs& a, int64_t b) {
  const int64_t N = a.p.num_rows;
  const int64_t lo = clamp64(a.p.seq_offsets[b], 0, N);
  const int64_t hi = clamp64(a.p.seq_offsets[b + 1], lo, N);
  return FinalizeSeq{lo, hi - lo, hi - lo <= kStageRows};
}

// Whether row n belongs to a sequence (the clamped offsets of finalize_seq): a row of none (bad
// offsets) keeps its outputs untouched, as the per-sequence walk of the host backend leaves them.
DINFER_HD bool row_in_a_sequence(const FinalizeArgs& a, int64_t n) {
  for (int64_t b = 0; b < a.p.num_seqs; ++b) {
    const FinalizeSeq q = finalize_seq(a, b);
    if (n >= q.lo && n < q.lo + q.L) return true;
  }
  return false;
}

// Thread 0 of the CTA that reduced unit u: publishes the unit's partial and takes the row's ticket.
// True for the row's last unit: that CTA merges the row. Release: the partial is visible device-wide
// (__threadfence) before the ticket counts it.
DINFER_HD bool publish_unit(const FinalizeArgs& a, uint32_t u, const Partial& part) {
  a.partials[u] = part;
  simt::threadfence();
  const uint32_t n = u / static_cast<uint32_t>(a.num_splits);
  return simt::atomic_add(a.tickets + n, 1) == a.num_splits - 1;
}

// A partial another CTA wrote in this launch: through L2 (L1 is not coherent), as two 16-byte loads.
DINFER_HD Partial load_partial(const Partial* src) {
  static_assert(sizeof(Partial) == 2 * sizeof(Load16), "a Partial is two 16-byte words");
  const Load16* w = reinterpret_cast<const Load16*>(src);
  const Load16 q[2] = {simt::load_cg(w), simt::load_cg(w + 1)};
  Partial r;
  memcpy(&r, q, sizeof r);
  return r;
}

// The last CTA of row n, thread tid, after its thread 0's ticket (then __threadfence: acquire) and a
// barrier: threads below num_splits stage one split's partial each, so the loads overlap.
DINFER_HD void stage_row_partials(const FinalizeArgs& a, int64_t n, int tid, Partial* staged) {
  if (tid < a.num_splits) staged[tid] = load_partial(a.partials + n * a.num_splits + tid);
}

// Then, after a barrier, one thread: merges the splits in split order (whichever CTA came last, the
// result is the same bits) and finalizes the row (steps 1-3 of the reference).
DINFER_HD void finalize_row_of(const FinalizeArgs& a, int64_t n, const Partial* staged) {
  if (!row_in_a_sequence(a, n)) return;
  const DecodeStepParams& p = a.p;
  const int64_t esize = p.logits_dtype == ScalarType::kFloat32 ? 4 : 2;
  Partial part = staged[0];
  for (int s = 1; s < a.num_splits; ++s) part = decode_math::merge(part, staged[s]);
  const void* row = static_cast<const char*>(p.logits) + n * p.row_stride * esize;
  const uint32_t key = decode_math::row_key(p.seed, p.offset, decode_math::row_counter(p.row_keys, n));
  const decode_math::RowResult r = decode_math::finalize_row(part, row, p, n, p.tokens[n] == p.mask_id, key);
  if (p.nonfinite != nullptr) p.nonfinite[n] = part.nonfinite != 0;
  p.candidate[n] = r.candidate;
  p.confidence[n] = r.confidence;
  a.fb_token[n] = r.fallback;
  a.fb_conf[n] = r.fallback_conf;
}

// ---- finalize: one CTA per sequence ---------------------------------------------------------------

constexpr int kFinalizeWarps = kFinalizeThreads / kWarpSize;

// Part of decode_math::sequence_stats over some rows of a sequence. The serial loop's result, made
// associative: the eligible row of highest confidence (lowest row on ties) among the non-NaN ones,
// the masked row of highest fallback probability > -inf, and the first masked / eligible rows. A NaN
// confidence never wins the loop, unless it is the first eligible row's: that case is patched after
// the reduction (finalize_stats). Rows are int32 (N * num_splits <= INT32_MAX); kNoIndex: none.
struct StatsPart {
  float max_c, best_fb;
  int32_t arg_c, fb_row, first_masked, first_eligible;
};

DINFER_HD StatsPart merge_stats(const StatsPart& a, const StatsPart& b) {
  StatsPart r;
  const bool bc = decode_math::beats(b.max_c, b.arg_c, a.max_c, a.arg_c);
  r.max_c = bc ? b.max_c : a.max_c;
  r.arg_c = bc ? b.arg_c : a.arg_c;
  const bool bf = decode_math::beats(b.best_fb, b.fb_row, a.best_fb, a.fb_row);
  r.best_fb = bf ? b.best_fb : a.best_fb;
  r.fb_row = bf ? b.fb_row : a.fb_row;
  r.first_masked = a.first_masked < b.first_masked ? a.first_masked : b.first_masked;
  r.first_eligible = a.first_eligible < b.first_eligible ? a.first_eligible : b.first_eligible;
  return r;
}

// What the phases share: the CTA's shared memory on the device.
struct FinalizeShared {
  int64_t tokens[kStageRows], cand[kStageRows];
  float conf[kStageRows], fb_conf[kStageRows];
  StatsPart warp_stats[kFinalizeWarps];
};

// Phase a, thread tid: stages its rows (strided; the split pass finalized them) in shared memory.
DINFER_HD void finalize_stage(const FinalizeArgs& a, const FinalizeSeq& q, FinalizeShared& sh, int tid) {
  if (!q.staged) return;
  const DecodeStepParams& p = a.p;
  for (int64_t i = tid; i < q.L; i += kFinalizeThreads) {
    const int64_t n = q.lo + i;
    sh.tokens[i] = p.tokens[n];
    sh.cand[i] = p.candidate[n];
    sh.conf[i] = p.confidence[n];
    sh.fb_conf[i] = a.fb_conf[n];
  }
}

// Phases b and c read the sequence's rows from here.
struct SeqView {
  const int64_t *tokens, *cand;
  const float *conf, *fb_conf;
};

DINFER_HD SeqView seq_view(const FinalizeArgs& a, const FinalizeSeq& q, const FinalizeShared& sh) {
  if (q.staged) return SeqView{sh.tokens, sh.cand, sh.conf, sh.fb_conf};
  return SeqView{a.p.tokens + q.lo, a.p.candidate + q.lo, a.p.confidence + q.lo, a.fb_conf + q.lo};
}

// Phase b, every thread: decode_math::sequence_stats as a block reduction. Each thread folds its
// rows (strided), each warp butterflies (every lane ends with the warp's part), and every thread folds
// the warps' parts in warp order: the same stats in every thread, whatever the arrival order.
DINFER_HD StatsPart shfl_xor(const StatsPart& x, int m) {
  StatsPart r;
  r.max_c = simt::shfl_xor(x.max_c, m);
  r.best_fb = simt::shfl_xor(x.best_fb, m);
  r.arg_c = simt::shfl_xor(x.arg_c, m);
  r.fb_row = simt::shfl_xor(x.fb_row, m);
  r.first_masked = simt::shfl_xor(x.first_masked, m);
  r.first_eligible = simt::shfl_xor(x.first_eligible, m);
  return r;
}

DINFER_HD decode_math::SeqStats finalize_stats(const FinalizeArgs& a, const FinalizeSeq& q, const SeqView& v,
                                               FinalizeShared& sh, int tid) {
  const int64_t mask_id = a.p.mask_id;
  StatsPart t{-INFINITY,
              -INFINITY,
              decode_math::kNoIndex,
              decode_math::kNoIndex,
              decode_math::kNoIndex,
              decode_math::kNoIndex};
  for (int64_t i = tid; i < q.L; i += kFinalizeThreads) {  // increasing i: the first row is the lowest
    if (!decode_math::is_masked(v.tokens, i, mask_id)) continue;
    const int32_t r = static_cast<int32_t>(i);
    if (t.first_masked == decode_math::kNoIndex) t.first_masked = r;
    if (decode_math::is_eligible(v.tokens, v.cand, i, mask_id)) {
      if (t.first_eligible == decode_math::kNoIndex) t.first_eligible = r;
      const float c = v.conf[i];
      if (c == c && decode_math::beats(c, r, t.max_c, t.arg_c)) {
        t.max_c = c;
        t.arg_c = r;
      }
    }
    if (v.fb_conf[i] > t.best_fb) {  // strict: -inf and NaN never become the fallback
      t.best_fb = v.fb_conf[i];
      t.fb_row = r;
    }
  }
  DINFER_UNROLL
  for (int m = kWarpSize / 2; m > 0; m /= 2) t = merge_stats(t, shfl_xor(t, m));
  if (tid % kWarpSize == 0) sh.warp_stats[tid / kWarpSize] = t;
  simt::sync_block();
  t = sh.warp_stats[0];
  for (int w = 1; w < kFinalizeWarps; ++w) t = merge_stats(t, sh.warp_stats[w]);

  decode_math::SeqStats st{-INFINITY, -1, -1};
  if (t.first_eligible != decode_math::kNoIndex && v.conf[t.first_eligible] != v.conf[t.first_eligible]) {
    st.max_c = v.conf[t.first_eligible];  // the loop's first pick, which nothing beats
    st.argmax_c = t.first_eligible;
  } else if (t.arg_c != decode_math::kNoIndex) {
    st.max_c = t.max_c;
    st.argmax_c = t.arg_c;
  }
  if (t.first_masked == decode_math::kNoIndex || st.argmax_c >= 0)
    st.fallback_row = -1;
  else if (t.fb_row != decode_math::kNoIndex)
    st.fallback_row = t.fb_row;
  else if (a.p.vocab > 1)
    st.fallback_row = t.first_masked;
  return st;
}

// Phase c, thread tid: commit decisions of its rows (the rule, the progress guarantee, the joint
// rule's edits), from the tokens as they were before this step.
DINFER_HD void finalize_decide(const FinalizeArgs& a, const FinalizeSeq& q, const SeqView& v,
                               const decode_math::SeqStats& st, int64_t b, int tid) {
  const DecodeStepParams& p = a.p;
  const float tau = p.threshold != nullptr ? p.threshold[b] : 1.0f;
  const int32_t k = p.num_commit != nullptr ? p.num_commit[b] : 0;
  for (int64_t i = tid; i < q.L; i += kFinalizeThreads) {
    const bool c = decode_math::row_commits(i, q.L, v.tokens, v.cand, v.conf, st, p.rule, tau,
                                            p.low_threshold, k, p.mask_id) ||
                   i == st.fallback_row ||
                   decode_math::row_edits(p, q.lo + i, v.tokens[i], v.cand[i], v.conf[i]);
    p.commit[q.lo + i] = c ? 1 : 0;
  }
}

// Phase d, thread tid: the progress guarantee, then the commit (only the owner touches row i).
DINFER_HD void finalize_write(const FinalizeArgs& a, const FinalizeSeq& q, const decode_math::SeqStats& st,
                              int tid) {
  const DecodeStepParams& p = a.p;
  for (int64_t i = tid; i < q.L; i += kFinalizeThreads) {
    const int64_t n = q.lo + i;
    if (i == st.fallback_row) {
      p.candidate[n] = a.fb_token[n];
      p.confidence[n] = fmaxf(a.fb_conf[n], 0.f);  // 0 for the default token (-inf fallback)
    }
    if (p.commit[n]) p.tokens[n] = p.candidate[n];
  }
}

// The finalize kernel's CTA b, thread tid, with its barriers: the device kernel's whole body, run by
// the SIMT emulator on the host. Rows are strided over the threads and the same thread owns a row in
// every phase, so the only cross-thread traffic is phases b and c reading other rows.
DINFER_HD void finalize_cta(const FinalizeArgs& a, FinalizeShared& sh, int64_t b, int tid) {
  const FinalizeSeq q = finalize_seq(a, b);
  if (q.L == 0) return;  // uniform per CTA: no thread reaches a barrier
  finalize_stage(a, q, sh, tid);
  simt::sync_block();
  const SeqView v = seq_view(a, q, sh);
  const decode_math::SeqStats st = finalize_stats(a, q, v, sh, tid);
  finalize_decide(a, q, v, st, b, tid);
  // Every decision has read tokens/candidates of other rows; only now may they change.
  simt::sync_block();
  finalize_write(a, q, st, tid);
}

}  // namespace decode_split
DINFER_ISA_END
}  // namespace dinfer_kernels
