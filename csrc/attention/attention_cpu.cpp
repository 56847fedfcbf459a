// Host window attention with partial KV refresh: the AttentionParams contract over host arrays.
//
// One task per (sequence, query head). A task first gathers its kv head's keys and values [0, L)
// into fp32 scratch -- the window's fresh rows substituted at their positions -- so the row loops
// below run over contiguous fp32 whatever the storage dtype, and write_back=false never copies or
// touches the cache. Each row then takes a two-pass softmax over the keys of the blocks its query
// block lists. A task owns its output rows and its row of block_mass, so the result does not depend
// on the thread count. With write_back the fresh rows are first written into the cache (a separate
// parallel loop, finished before any task reads the cache).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "dinfer_kernels/attention.h"
#include "dinfer_kernels/attention_math.h"
#include "dinfer_kernels/host_exp.h"
#include "dinfer_kernels/scalar.h"

namespace dinfer_kernels {
namespace {

using attention_math::row_valid;
using attention_math::valid_len;

float load(const void* base, int64_t i, ScalarType t) {
  switch (t) {
    case ScalarType::kFloat16:
      return scalar::fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case ScalarType::kBFloat16:
      return scalar::bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

void store(void* base, int64_t i, float x, ScalarType t) {
  switch (t) {
    case ScalarType::kFloat16:
      static_cast<uint16_t*>(base)[i] = scalar::float_to_fp16(x);
      break;
    case ScalarType::kBFloat16:
      static_cast<uint16_t*>(base)[i] = scalar::float_to_bf16(x);
      break;
    default:
      static_cast<float*>(base)[i] = x;
  }
}

size_t elem_bytes(ScalarType t) { return t == ScalarType::kFloat32 ? 4 : 2; }

// D contiguous elements of `src` (element offset `at`) converted to fp32 in `dst`.
void load_row(const void* src, int64_t at, int64_t d, ScalarType t, float* dst) {
  if (t == ScalarType::kFloat32) {
    std::memcpy(dst, static_cast<const float*>(src) + at, static_cast<size_t>(d) * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < d; ++i) dst[i] = load(src, at + i, t);
}

// Element offset of [i0, i1, i2, 0] in an array with leading strides s.
int64_t offset(const int64_t (&s)[3], int64_t i0, int64_t i1, int64_t i2) {
  return i0 * s[0] + i1 * s[1] + i2 * s[2];
}

// The fresh K/V of valid window rows into the cache rows at their positions (write_back).
void write_back_rows(const AttentionParams& p, int threads) {
  const size_t row_bytes = static_cast<size_t>(p.head_dim) * elem_bytes(p.dtype);
  char* kc = static_cast<char*>(p.k_cache);
  char* vc = static_cast<char*>(p.v_cache);
  const char* k = static_cast<const char*>(p.k);
  const char* v = static_cast<const char*>(p.v);
  const int64_t eb = static_cast<int64_t>(elem_bytes(p.dtype));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t bw = 0; bw < p.batch * p.window; ++bw) {
    const int64_t b = bw / p.window, w = bw % p.window;
    const int64_t pos = p.positions[bw];
    if (!row_valid(pos, valid_len(p.seq_lens[b], static_cast<int32_t>(p.cache_len)))) continue;
    for (int64_t g = 0; g < p.heads_kv; ++g) {
      std::memcpy(kc + offset(p.k_cache_stride, b, pos, g) * eb, k + offset(p.k_stride, b, w, g) * eb,
                  row_bytes);
      std::memcpy(vc + offset(p.v_cache_stride, b, pos, g) * eb, v + offset(p.v_stride, b, w, g) * eb,
                  row_bytes);
    }
  }
}

// Marks in `allowed` (NKB flags) the key blocks query block j of (b, g) lists; out-of-range entries
// are skipped and the count is clamped to [0, max_blocks]. Returns the listed blocks, ascending.
void listed_blocks(const AttentionParams& p, int64_t b, int64_t g, int64_t j, int64_t nkb,
                   std::vector<char>& allowed, std::vector<int32_t>& blocks) {
  blocks.clear();
  if (p.kv_num_blocks == nullptr) {
    for (int64_t kb = 0; kb < nkb; ++kb) blocks.push_back(static_cast<int32_t>(kb));
    return;
  }
  const int64_t nqb = attention_math::cdiv(p.window, p.q_block);
  const int64_t at = (b * p.heads_kv + g) * nqb + j;
  const int64_t count = std::min<int64_t>(std::max<int32_t>(p.kv_num_blocks[at], 0), p.max_blocks);
  std::fill(allowed.begin(), allowed.end(), 0);
  for (int64_t i = 0; i < count; ++i) {
    const int32_t kb = p.kv_indices[at * p.max_blocks + i];
    if (kb >= 0 && kb < nkb) allowed[kb] = 1;
  }
  for (int64_t kb = 0; kb < nkb; ++kb)
    if (allowed[kb]) blocks.push_back(static_cast<int32_t>(kb));
}

// Sum of x[0, n) in kLanes independent accumulators: vectorises without -ffast-math.
// The row loops keep their accumulators in registers as 16-float vectors (GCC/Clang vector
// extensions: one AVX-512 register, or two AVX / four SSE ones, whatever -march allows), four
// independent ones at a time: a single FMA chain would be latency-bound.
constexpr int kLanes = 16;
constexpr int kChains = 4;
typedef float v16 __attribute__((vector_size(kLanes * sizeof(float))));
inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// max of x[0, n) (n >= 1) in kLanes independent lanes.
float lane_max(const float* x, int64_t n) {
  float lane[kLanes];
  for (int j = 0; j < kLanes; ++j) lane[j] = -INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  float m = -INFINITY;
  for (int j = 0; j < kLanes; ++j) m = lane[j] > m ? lane[j] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
float lane_sum(const float* x, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += x[i + j];
  float total = 0.f;
  for (int j = 0; j < kLanes; ++j) total += lane[j];
  for (; i < n; ++i) total += x[i];
  return total;
}

// Horizontal sum of a 16-float vector.
inline float hsum(v16 v) {
  float h = 0.f;
  for (int l = 0; l < kLanes; ++l) h += v[l];
  return h;
}

struct Scratch {
  std::vector<const float*> key_rows, value_rows;  // [L]: fp32 row t of the task's kv head
  std::vector<float> keys, values;                 // [L, D]: converted rows (16-bit dtypes only)
  std::vector<char> ready;                         // [NKB]: the block's rows are set
  std::vector<float> scores, q, acc, parts;        // parts: each listed block's share of the exp-sum
  std::vector<char> allowed;
  std::vector<int32_t> blocks;
};

// Sets the row pointers of key block kb: fp32 rows are read in place (the window's fresh row where
// `slot` names one, else the cache row), 16-bit rows are converted into the scratch once.
void prepare_block(const AttentionParams& p, const int32_t* slot, int64_t b, int64_t g, int32_t L,
                   int32_t kb, Scratch& s) {
  if (s.ready[kb]) return;
  s.ready[kb] = 1;
  const int64_t D = p.head_dim;
  const int64_t t1 = std::min<int64_t>((kb + 1) * p.kv_block, L);
  for (int64_t t = kb * p.kv_block; t < t1; ++t) {
    const int32_t w = slot ? slot[b * p.cache_len + t] : -1;
    const void* kbase = w >= 0 ? p.k : p.k_cache;
    const void* vbase = w >= 0 ? p.v : p.v_cache;
    const int64_t ko = w >= 0 ? offset(p.k_stride, b, w, g) : offset(p.k_cache_stride, b, t, g);
    const int64_t vo = w >= 0 ? offset(p.v_stride, b, w, g) : offset(p.v_cache_stride, b, t, g);
    if (p.dtype == ScalarType::kFloat32) {
      s.key_rows[t] = static_cast<const float*>(kbase) + ko;
      s.value_rows[t] = static_cast<const float*>(vbase) + vo;
    } else {
      load_row(kbase, ko, D, p.dtype, &s.keys[t * D]);
      load_row(vbase, vo, D, p.dtype, &s.values[t * D]);
      s.key_rows[t] = &s.keys[t * D];
      s.value_rows[t] = &s.values[t * D];
    }
  }
}

void attend_head(const AttentionParams& p, const int32_t* slot, int64_t b, int64_t h, Scratch& s) {
  const int64_t D = p.head_dim, S = p.cache_len, W = p.window;
  const int64_t D16 = D / kLanes * kLanes;  // dims [0, D16) in vectors, the rest one by one
  const int64_t g = h / (p.heads_q / p.heads_kv);
  const int32_t L = valid_len(p.seq_lens[b], static_cast<int32_t>(S));
  const int64_t nkb = attention_math::cdiv(S, p.kv_block);
  const float kNegInf = -INFINITY;

  s.key_rows.resize(L);
  s.value_rows.resize(L);
  if (p.dtype != ScalarType::kFloat32) {
    s.keys.resize(static_cast<size_t>(L) * D);
    s.values.resize(static_cast<size_t>(L) * D);
  }
  s.ready.assign(nkb, 0);
  float* mass = p.block_mass ? p.block_mass + (b * p.heads_q + h) * nkb : nullptr;
  if (mass) std::fill(mass, mass + nkb, 0.f);
  s.scores.resize(static_cast<size_t>(std::max<int32_t>(L, 1)));
  s.q.resize(D);
  s.acc.resize(D);
  s.allowed.resize(nkb);
  int64_t listed_for = -1;  // query block whose list s.blocks holds
  float* __restrict sc = s.scores.data();
  float* __restrict acc = s.acc.data();
  const float* __restrict q = s.q.data();

  for (int64_t w = 0; w < W; ++w) {
    const int64_t pos = p.positions[b * W + w];
    const int64_t o = offset(p.out_stride, b, w, h);
    float* lse = p.lse ? p.lse + (b * W + w) * p.heads_q + h : nullptr;
    std::fill(acc, acc + D, 0.f);
    float row_lse = kNegInf;
    if (row_valid(pos, L)) {
      const int64_t j = w / p.q_block;
      if (j != listed_for) {
        listed_blocks(p, b, g, j, nkb, s.allowed, s.blocks);
        listed_for = j;
      }
      load_row(p.q, offset(p.q_stride, b, w, h), D, p.dtype, s.q.data());
      for (float& x : s.q) x *= p.scale;
      float m = kNegInf, sum = 0.f;
      for (int32_t kb : s.blocks) {       // scores of the listed keys, four keys at a time
        const int64_t t0 = kb * p.kv_block, t1 = std::min<int64_t>(t0 + p.kv_block, L);
        if (t0 >= t1) continue;
        prepare_block(p, slot, b, g, L, kb, s);
        int64_t t = t0;
        for (; t + kChains <= t1; t += kChains) {
          const float *k0 = s.key_rows[t], *k1 = s.key_rows[t + 1], *k2 = s.key_rows[t + 2],
                      *k3 = s.key_rows[t + 3];
          v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
          for (int64_t d = 0; d < D16; d += kLanes) {
            const v16 qd = load16(q + d);
            a0 += qd * load16(k0 + d);
            a1 += qd * load16(k1 + d);
            a2 += qd * load16(k2 + d);
            a3 += qd * load16(k3 + d);
          }
          float r0 = hsum(a0), r1 = hsum(a1), r2 = hsum(a2), r3 = hsum(a3);
          for (int64_t d = D16; d < D; ++d) {
            r0 += q[d] * k0[d];
            r1 += q[d] * k1[d];
            r2 += q[d] * k2[d];
            r3 += q[d] * k3[d];
          }
          sc[t] = r0;
          sc[t + 1] = r1;
          sc[t + 2] = r2;
          sc[t + 3] = r3;
        }
        for (; t < t1; ++t) {
          const float* k0 = s.key_rows[t];
          v16 a0 = {};
          for (int64_t d = 0; d < D16; d += kLanes) a0 += load16(q + d) * load16(k0 + d);
          float r0 = hsum(a0);
          for (int64_t d = D16; d < D; ++d) r0 += q[d] * k0[d];
          sc[t] = r0;
        }
        m = std::max(m, lane_max(sc + t0, t1 - t0));
      }
      if (m != kNegInf) {
        s.parts.assign(s.blocks.size(), 0.f);
        for (size_t i = 0; i < s.blocks.size(); ++i) {
          const int32_t kb = s.blocks[i];
          const int64_t t0 = kb * p.kv_block, t1 = std::min<int64_t>(t0 + p.kv_block, L);
          if (t0 >= t1) continue;
          for (int64_t t = t0; t < t1; ++t) sc[t] = host::exp_nonpositive(sc[t] - m);
          s.parts[i] = lane_sum(sc + t0, t1 - t0);
          sum += s.parts[i];
          const float* const* vr = s.value_rows.data();
          for (int64_t d0 = 0; d0 < D16; d0 += kLanes) {   // acc[d0, d0 + 16) in kChains registers
            v16 p0 = {}, p1 = {}, p2 = {}, p3 = {};
            int64_t t = t0;
            for (; t + kChains <= t1; t += kChains) {
              p0 += sc[t] * load16(vr[t] + d0);
              p1 += sc[t + 1] * load16(vr[t + 1] + d0);
              p2 += sc[t + 2] * load16(vr[t + 2] + d0);
              p3 += sc[t + 3] * load16(vr[t + 3] + d0);
            }
            for (; t < t1; ++t) p0 += sc[t] * load16(vr[t] + d0);
            store16(acc + d0, load16(acc + d0) + ((p0 + p1) + (p2 + p3)));
          }
          for (int64_t d = D16; d < D; ++d) {
            float a = 0.f;
            for (int64_t t = t0; t < t1; ++t) a += sc[t] * vr[t][d];
            acc[d] += a;
          }
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < D; ++d) acc[d] *= inv;
        row_lse = m + std::log(sum);
        if (mass)
          for (size_t i = 0; i < s.blocks.size(); ++i) mass[s.blocks[i]] += s.parts[i] * inv;
      }
    }
    for (int64_t d = 0; d < D; ++d) store(p.out, o + d, acc[d], p.dtype);
    if (lse) *lse = row_lse;
  }
}

}  // namespace

void attention_cpu(const AttentionParams& p, int num_threads) {
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  // Without write_back the window's fresh rows stand in for their cache rows: slot[b * S + t] is
  // the window row at position t, or -1. With it they are written into the cache first.
  std::vector<int32_t> slot;
  if (p.write_back) {
    write_back_rows(p, threads);
  } else {
    slot.assign(static_cast<size_t>(p.batch * p.cache_len), -1);
    for (int64_t b = 0; b < p.batch; ++b) {
      const int32_t L = valid_len(p.seq_lens[b], static_cast<int32_t>(p.cache_len));
      for (int64_t w = 0; w < p.window; ++w) {
        const int64_t pos = p.positions[b * p.window + w];
        if (row_valid(pos, L)) slot[b * p.cache_len + pos] = static_cast<int32_t>(w);
      }
    }
  }
  const int32_t* slots = p.write_back ? nullptr : slot.data();
  const int64_t tasks = p.batch * p.heads_q;
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) attend_head(p, slots, t / p.heads_q, t % p.heads_q, scratch);
  }
}

}  // namespace dinfer_kernels
