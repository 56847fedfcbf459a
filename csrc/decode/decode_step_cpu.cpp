// Host decode step: OpenMP over (row, vocabulary chunk) tasks for the single read of the logits,
// then the shared decode_math finalize and commit code.
//
// The pass over a chunk is written in register-wide vectors (host_math.h vreg), so the conversion, sanitising,
// max and exp-sum are vector code on every ISA, without -ffast-math and without relying on the
// auto-vectoriser (which gives up on their selects without AVX-512's masks).
#include <algorithm>
#include <cstring>
#include <vector>

#include <omp.h>

#include "dinfer_kernels/decode.h"
#include "dinfer_kernels/decode_math.h"
#include "dinfer_kernels/host_math.h"
#include "dinfer_kernels/isa_namespace.h"
#include "dinfer_kernels/host_rows.h"

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

// Converts and sanitises [lo, lo + len) of a row into buf; returns the chunk's max.
template <ScalarType T>
float load_chunk_max(const void* row, int64_t lo, int64_t len, float* buf) {
  vreg m0 = host::splat<vreg>(-INFINITY), m1 = m0;   // two chains: the max latency is not the limit
  int64_t i = 0;
  for (; i + 2 * kRegLanes <= len; i += 2 * kRegLanes) {
    const vreg z0 = sanitize_v(host::load_vreg<T>(row, lo + i));
    const vreg z1 = sanitize_v(host::load_vreg<T>(row, lo + i + kRegLanes));
    host::storev(buf + i, z0);
    host::storev(buf + i + kRegLanes, z1);
    m0 = z0 > m0 ? z0 : m0;
    m1 = z1 > m1 ? z1 : m1;
  }
  float m = host::hmax(m0 > m1 ? m0 : m1);
  for (; i < len; ++i) {
    buf[i] = decode_math::load_logit(row, T, lo + i);
    m = buf[i] > m ? buf[i] : m;
  }
  return m;
}

float load_chunk(const void* row, ScalarType t, int64_t lo, int64_t len, float* buf) {
  switch (t) {
    case ScalarType::kFloat32: return load_chunk_max<ScalarType::kFloat32>(row, lo, len, buf);
    case ScalarType::kBFloat16: return load_chunk_max<ScalarType::kBFloat16>(row, lo, len, buf);
    default: return load_chunk_max<ScalarType::kFloat16>(row, lo, len, buf);
  }
}

float chunk_sum_exp(const float* buf, int64_t len, float m) {
  vreg s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 2 * kRegLanes <= len; i += 2 * kRegLanes) {
    s0 += exp_nonpositive(host::loadv<vreg>(buf + i) - m);
    s1 += exp_nonpositive(host::loadv<vreg>(buf + i + kRegLanes) - m);
  }
  float s = host::hsum(s0 + s1);
  for (; i < len; ++i) s += exp_nonpositive(buf[i] - m);
  return s;
}

// Lowest index in buf holding exactly m, skipping `skip` (-1: none).
int64_t first_index_of(const float* buf, int64_t len, float m, int64_t skip) {
  for (int64_t i = 0; i < len; ++i)
    if (buf[i] == m && i != skip) return i;
  return -1;
}

// Whether raw elements [lo, lo + len) hold a NaN or +-inf: an all-ones exponent field. Read from
// the raw row, which the sanitised copy cannot tell (NaN and -inf both become -inf there); a branch-
// free OR over integer bits that the compiler vectorises, on a chunk just loaded into L1.
template <class Bits, Bits kExp>
bool bits_nonfinite(const void* row, int64_t lo, int64_t len) {
  const Bits* b = static_cast<const Bits*>(row) + lo;
  Bits any = 0;
  for (int64_t i = 0; i < len; ++i) any |= static_cast<Bits>((b[i] & kExp) == kExp);
  return any != 0;
}

bool chunk_nonfinite(const void* row, ScalarType t, int64_t lo, int64_t len) {
  switch (t) {
    case ScalarType::kFloat32: return bits_nonfinite<uint32_t, 0x7F800000u>(row, lo, len);
    case ScalarType::kBFloat16: return bits_nonfinite<uint16_t, 0x7F80u>(row, lo, len);
    default: return bits_nonfinite<uint16_t, 0x7C00u>(row, lo, len);
  }
}

Partial scan_chunk(const DecodeStepParams& p, int64_t n, int64_t lo, int64_t len, float* buf) {
  const void* row = static_cast<const char*>(p.logits) +
                    n * p.row_stride * (p.logits_dtype == ScalarType::kFloat32 ? 4 : 2);
  Partial r = decode_math::empty_partial();
  r.max = load_chunk(row, p.logits_dtype, lo, len, buf);
  r.nonfinite = chunk_nonfinite(row, p.logits_dtype, lo, len) ? 1 : 0;
  if (r.max == -INFINITY) return r;  // nothing but -inf: merges as empty
  r.sum = chunk_sum_exp(buf, len, r.max);
  r.arg = static_cast<int32_t>(lo + first_index_of(buf, len, r.max, -1));
  const int64_t mask_local = p.mask_id >= lo && p.mask_id < lo + len ? p.mask_id - lo : -1;
  if (p.temperature > 0.f) {
    // Sampling is rare and its noise costs two logs per element anyway: a plain scalar loop.
    const uint32_t key = decode_math::row_key(p.seed, p.offset, decode_math::row_counter(p.row_keys, n));
    for (int64_t i = 0; i < len; ++i) {
      const float s = decode_math::score_of(buf[i], p.temperature, key, lo + i);
      const int32_t v = static_cast<int32_t>(lo + i);
      if (decode_math::beats(s, v, r.score, r.score_arg)) { r.score = s; r.score_arg = v; }
      if (i != mask_local && decode_math::beats(s, v, r.nm_score, r.nm_arg)) { r.nm_score = s; r.nm_arg = v; }
    }
    return r;
  }
  r.score = r.max;
  r.score_arg = r.arg;
  r.nm_score = r.max;
  r.nm_arg = r.arg;
  if (r.arg - lo == mask_local) {  // the raw best is the mask token: find the best other token
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
    const decode_math::RowResult r =
        decode_math::finalize_row(acc, row, p, n, p.tokens[n] == p.mask_id, key);
    if (p.nonfinite != nullptr) p.nonfinite[n] = acc.nonfinite != 0;
    p.candidate[n] = r.candidate;
    p.confidence[n] = r.confidence;
    p.row_max[n] = r.max;
    p.row_lse[n] = r.lse;
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
    const decode_math::SeqStats s = decode_math::sequence_stats(
        L, tok, cand, conf, fallback_conf.data() + lo, p.mask_id, V > 1);
    const float tau = p.threshold ? p.threshold[b] : 1.f;
    const int32_t k = p.num_commit ? p.num_commit[b] : 0;
    for (int64_t i = 0; i < L; ++i)
      p.commit[lo + i] = decode_math::row_commits(i, L, tok, cand, conf, s, p.rule, tau,
                                                  p.low_threshold, k, p.mask_id) ||
                         i == s.fallback_row;
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
