// Host decode step: OpenMP over (row, vocabulary chunk) tasks for the single read of the logits,
// then the shared decode_math finalize and commit code.
//
// The pass over a chunk is written in register-wide vectors (host_math.h vreg), so the conversion, sanitising,
// max and exp-sum are vector code on every ISA, without -ffast-math and without relying on the
// auto-vectoriser (which gives up on their selects without AVX-512's masks).
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "dinfer_kernels/decode.h"
#include "dinfer_kernels/detail/decode_math.h"
#include "dinfer_kernels/detail/host_math.h"
#include "dinfer_kernels/detail/host_rows.h"
#include "dinfer_kernels/detail/isa_namespace.h"

// 16-float vectors by value between internal inlined functions (see host_math.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace {

using decode_math::Partial;
using host::exp_nonpositive;
using host::kLanes;
using host::lane_max;

using host::kRegLanes;
using host::vreg;

constexpr int64_t kChunk = 4096;  // floats per task: 16 KB stays in L1/L2 between the sub-passes

// sanitize() with selects only (fminf keeps NaN semantics that block vectorisation).
inline vreg sanitize_v(vreg z) {
  z = z != z ? host::splat<vreg>(-INFINITY) : z;
  return z > FLT_MAX ? host::splat<vreg>(FLT_MAX) : z;
}

// The lane indices 0, 1, ..., kRegLanes - 1 as an integer vector of the select's mask type.
using vidx = decltype(vreg{} < vreg{});
inline vidx lane_iota() {
  vidx v = {};
  for (int j = 0; j < kRegLanes; ++j) v[j] = j;
  return v;
}

// The storage type of one logit of dtype T.
template <ScalarType T>
using Elem = std::conditional_t<T == ScalarType::kFloat32, float, uint16_t>;

// Whether raw elements [lo, lo + len) hold a NaN or +-inf: an all-ones exponent field (for the
// scalar tail of a chunk, whose sanitised values cannot tell NaN from -inf).
template <class Bits, Bits kExp>
bool bits_nonfinite(const void* row, int64_t lo, int64_t len) {
  const Bits* b = static_cast<const Bits*>(row) + lo;
  Bits any = 0;
  for (int64_t i = 0; i < len; ++i) any |= static_cast<Bits>((b[i] & kExp) == kExp);
  return any != 0;
}

bool chunk_nonfinite(const void* row, ScalarType t, int64_t lo, int64_t len) {
  switch (t) {
    case ScalarType::kFloat32:
      return bits_nonfinite<uint32_t, 0x7F800000u>(row, lo, len);
    case ScalarType::kBFloat16:
      return bits_nonfinite<uint16_t, 0x7F80u>(row, lo, len);
    default:
      return bits_nonfinite<uint16_t, 0x7C00u>(row, lo, len);
  }
}

// A chunk's row statistics: the max and first index of the sanitised logits (-inf and -1 when they
// are all -inf) and the sum of exp(z - max).
struct ChunkStats {
  float max, sum;
  int64_t arg;
  bool nonfinite;  // the raw chunk held a NaN or +-inf (sanitising hides it from max and sum)
};

// The statistics of [lo, lo + len) of a row of T, in two passes over the chunk (the second from L1):
// 1. max and argmax of the raw logits, each of kChains vector chains keeping per lane its running max
//    and where it first reached it (a strict > keeps the first). NaN never wins a compare (as
//    sanitised, -inf); only +inf needs a fix-up (sanitised it is FLT_MAX, tied with a real FLT_MAX):
//    a scalar rescan, and a sanitised exp-sum, when the max is +inf.
// 2. the exp-sum of the raw logits minus the max by exp_term (the sanitising folded into its clamp),
//    prefetching the next chunk in memory (the next task of this thread) meanwhile: the exp work
//    hides the next chunk's memory latency, so pass 1 reads from cache.
// Nothing is stored: the passes are loads and arithmetic only (a sanitised copy plus a scalar argmax
// rescan of it cost twice the exp-sum).
template <ScalarType T>
ChunkStats chunk_stats(const void* row, int64_t lo, int64_t len) {
  constexpr int kChains = 4;  // independent compare-select chains: their latency is not the limit
  constexpr int64_t kStep = kChains * kRegLanes;
  vreg m[kChains], nf[kChains];  // nf: z * 0 summed, NaN once any z was NaN or +-inf
  vidx first[kChains];
  vidx at = lane_iota();
  for (int c = 0; c < kChains; ++c) {
    m[c] = host::splat<vreg>(-INFINITY);
    nf[c] = vreg{};
    first[c] = vidx{} + INT32_MAX;
  }
  int64_t i = 0;
  for (; i + kStep <= len; i += kStep, at += kStep) {
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
      const vreg z = host::load_vreg<T>(row, lo + i + c * kRegLanes);
      const vidx up = z > m[c];
      m[c] = up ? z : m[c];
      first[c] = up ? at + c * kRegLanes : first[c];
      nf[c] += z * 0.f;
    }
  }
  ChunkStats r{-INFINITY, 0.f, -1, chunk_nonfinite(row, T, lo + i, len - i)};  // the tail by its bits
  for (int c = 0; c < kChains; ++c)
    for (int j = 0; j < kRegLanes; ++j) r.nonfinite |= nf[c][j] != nf[c][j];
  for (int c = 0; c < kChains; ++c) r.max = std::max(r.max, host::hmax(m[c]));
  int32_t arg = INT32_MAX;
  for (int c = 0; c < kChains; ++c)
    for (int j = 0; j < kRegLanes; ++j)
      if (m[c][j] == r.max && first[c][j] < arg) arg = first[c][j];
  if (r.max > -INFINITY) r.arg = arg;
  for (; i < len; ++i) {  // the tail comes after every vector index: only a strict > moves the argmax
    const float z = decode_math::load_logit(row, T, lo + i);
    if (z > r.max) r.max = z, r.arg = i;
  }
  if (r.max == -INFINITY) return r;
  i = 0;
  // sanitised: FLT_MAX, first held by a +inf or a FLT_MAX (the scalar tail reads sanitised values, so
  // a +inf there shows as FLT_MAX: the raw vector sum would then meet inf - FLT_MAX)
  if (r.max >= FLT_MAX) {
    r.max = FLT_MAX;
    for (r.arg = 0; decode_math::load_logit(row, T, lo + r.arg) != FLT_MAX; ++r.arg) {}
  } else {
    const char* next = static_cast<const char*>(row) + (lo + len) * static_cast<int64_t>(sizeof(Elem<T>));
    // Independent exps per iteration: 32 floats on AVX-512, 16 on AVX2 and SSE2 (whose mul + add
    // polynomial chain is twice as long without FMA).
    constexpr int kSums = kRegLanes >= 16 ? 2 : 16 / kRegLanes;
    constexpr int64_t kSumStep = kSums * kRegLanes;
    constexpr int64_t kLine = 64 / sizeof(Elem<T>);  // elements per cache line
    // Summed in blocks of 512 elements, each block's sums then added to the running ones. A lane
    // whose running sum holds the chunk's max (exp(0) = 1) rounds each small term it takes to an ulp
    // of 1; on a peaked row (one token far above the rest, as models give) the terms are alike, so
    // those roundings add up instead of cancelling: 4e-6 of the confidence at V = 32003, 10x the
    // torch reference's error. In a block, the terms meet sums of their own size; the running sums
    // take 8 block sums per chunk.
    constexpr int64_t kBlockSteps = 512 / kSumStep;
    vreg sums[kSums] = {};
    while (i + kSumStep <= len) {
      vreg block[kSums] = {};
      for (int64_t b = 0; b < kBlockSteps && i + kSumStep <= len; ++b, i += kSumStep) {
        for (int64_t l = 0; l < kSumStep; l += kLine) __builtin_prefetch(next + (i + l) * sizeof(Elem<T>));
#pragma GCC unroll 4
        for (int c = 0; c < kSums; ++c)
          block[c] += host::exp_term(host::load_vreg<T>(row, lo + i + c * kRegLanes) - r.max);
      }
      for (int c = 0; c < kSums; ++c) sums[c] += block[c];
    }
    for (int c = 1; c < kSums; ++c) sums[0] += sums[c];
    r.sum = host::hsum(sums[0]);
  }
  for (; i < len; ++i) r.sum += exp_nonpositive(decode_math::load_logit(row, T, lo + i) - r.max);
  return r;
}

// [lo, lo + len) of a row of T, sanitised, into buf (for the rarer passes that revisit the chunk).
template <ScalarType T>
void fill_chunk(const void* row, int64_t lo, int64_t len, float* buf) {
  int64_t i = 0;
  for (; i + kRegLanes <= len; i += kRegLanes)
    host::storev(buf + i, sanitize_v(host::load_vreg<T>(row, lo + i)));
  for (; i < len; ++i) buf[i] = decode_math::load_logit(row, T, lo + i);
}

// f(std::integral_constant<ScalarType, t>) for the logits dtype t.
template <typename F>
auto with_dtype(ScalarType t, F&& f) {
  switch (t) {
    case ScalarType::kFloat32:
      return f(std::integral_constant<ScalarType, ScalarType::kFloat32>{});
    case ScalarType::kBFloat16:
      return f(std::integral_constant<ScalarType, ScalarType::kBFloat16>{});
    default:
      return f(std::integral_constant<ScalarType, ScalarType::kFloat16>{});
  }
}

ChunkStats chunk_stats(const void* row, ScalarType t, int64_t lo, int64_t len) {
  return with_dtype(t, [&](auto T) { return chunk_stats<decltype(T)::value>(row, lo, len); });
}

void fill_chunk(const void* row, ScalarType t, int64_t lo, int64_t len, float* buf) {
  with_dtype(t, [&](auto T) { fill_chunk<decltype(T)::value>(row, lo, len, buf); });
}

// Lowest index in buf holding exactly m, skipping `skip` (-1: none).
int64_t first_index_of(const float* buf, int64_t len, float m, int64_t skip) {
  for (int64_t i = 0; i < len; ++i)
    if (buf[i] == m && i != skip) return i;
  return -1;
}

Partial scan_chunk(const DecodeStepParams& p, int64_t n, int64_t lo, int64_t len, float* buf) {
  const void* row = static_cast<const char*>(p.logits) +
                    n * p.row_stride * (p.logits_dtype == ScalarType::kFloat32 ? 4 : 2);
  Partial r = decode_math::empty_partial();
  const ChunkStats st = chunk_stats(row, p.logits_dtype, lo, len);
  r.nonfinite = st.nonfinite ? 1 : 0;
  if (st.max == -INFINITY) return r;  // nothing but -inf: merges as empty
  r.max = st.max;
  r.sum = st.sum;
  r.arg = static_cast<int32_t>(lo + st.arg);
  const int64_t mask_local = p.mask_id >= lo && p.mask_id < lo + len ? p.mask_id - lo : -1;
  if (p.temperature > 0.f) {
    fill_chunk(row, p.logits_dtype, lo, len, buf);
    // Sampling is rare and its noise costs two logs per element anyway: a plain scalar loop.
    const uint32_t key = decode_math::row_key(p.seed, p.offset, decode_math::row_counter(p.row_keys, n));
    for (int64_t i = 0; i < len; ++i) {
      const float s = decode_math::score_of(buf[i], p.temperature, key, lo + i);
      const int32_t v = static_cast<int32_t>(lo + i);
      if (decode_math::beats(s, v, r.score, r.score_arg)) {
        r.score = s;
        r.score_arg = v;
      }
      if (i != mask_local && decode_math::beats(s, v, r.nm_score, r.nm_arg)) {
        r.nm_score = s;
        r.nm_arg = v;
      }
    }
    return r;
  }
  r.score = r.max;
  r.score_arg = r.arg;
  r.nm_score = r.max;
  r.nm_arg = r.arg;
  if (r.arg - lo == mask_local) {  // the raw best is the mask token: find the best other token
    fill_chunk(row, p.logits_dtype, lo, len, buf);
    int64_t other = first_index_of(buf, len, r.max, mask_local);
    if (other < 0) {
      const float keep = buf[mask_local];
      buf[mask_local] = -INFINITY;
      const float m2 = lane_max(buf, len);
      other = first_index_of(buf, len, m2, -1);
      buf[mask_local] = keep;
      r.nm_score = m2;
    }
    r.nm_arg = static_cast<int32_t>(lo + other);
  }
  return r;
}

}  // namespace

void decode_step_cpu(const DecodeStepParams& p, int num_threads) {
  const int64_t N = p.num_rows, V = p.vocab;
  if (N <= 0) return;
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  std::vector<Partial> parts(static_cast<size_t>(N * chunks));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf(kChunk);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < N * chunks; ++t) {
      const int64_t n = t / chunks, c = t % chunks;
      const int64_t lo = c * kChunk;
      parts[t] = scan_chunk(p, n, lo, std::min(kChunk, V - lo), buf.data());
    }
  }

  std::vector<int64_t> fallback(N);
  std::vector<float> fallback_conf(N);
  const size_t elem = p.logits_dtype == ScalarType::kFloat32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = 0; n < N; ++n) {
    Partial acc = parts[n * chunks];
    for (int64_t c = 1; c < chunks; ++c) acc = decode_math::merge(acc, parts[n * chunks + c]);
    const void* row = static_cast<const char*>(p.logits) + n * p.row_stride * elem;
    const uint32_t key = decode_math::row_key(p.seed, p.offset, decode_math::row_counter(p.row_keys, n));
    const decode_math::RowResult r = decode_math::finalize_row(acc, row, p, n, p.tokens[n] == p.mask_id, key);
    if (p.nonfinite != nullptr) p.nonfinite[n] = acc.nonfinite != 0;
    p.candidate[n] = r.candidate;
    p.confidence[n] = r.confidence;
    fallback[n] = r.fallback;
    fallback_conf[n] = r.fallback_conf;
  }

#pragma omp parallel for schedule(dynamic) num_threads(threads)
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t lo = std::clamp<int64_t>(p.seq_offsets[b], 0, N);
    const int64_t hi = std::clamp<int64_t>(p.seq_offsets[b + 1], lo, N);
    const int64_t L = hi - lo;
    int64_t* tok = p.tokens + lo;
    int64_t* cand = p.candidate + lo;
    float* conf = p.confidence + lo;
    const decode_math::SeqStats s =
        decode_math::sequence_stats(L, tok, cand, conf, fallback_conf.data() + lo, p.mask_id, V > 1);
    const float tau = p.threshold ? p.threshold[b] : 1.f;
    const int32_t k = p.num_commit ? p.num_commit[b] : 0;
    for (int64_t i = 0; i < L; ++i)
      p.commit[lo + i] =
          decode_math::row_commits(i, L, tok, cand, conf, s, p.rule, tau, p.low_threshold, k, p.mask_id) ||
          i == s.fallback_row || decode_math::row_edits(p, lo + i, tok[i], cand[i], conf[i]);
    if (s.fallback_row >= 0) {
      cand[s.fallback_row] = fallback[lo + s.fallback_row];
      conf[s.fallback_row] = std::max(fallback_conf[lo + s.fallback_row], 0.f);  // 0: default token
    }
    for (int64_t i = 0; i < L; ++i)
      if (p.commit[lo + i]) tok[i] = cand[i];
  }
}

DINFER_ISA_END
}  // namespace dinfer_kernels
