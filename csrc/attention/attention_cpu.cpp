// Host window attention with partial KV refresh: the AttentionParams contract over host arrays.
//
// One task per (sequence, query head); a task owns its output rows and its row of block_mass, so the
// result does not depend on the thread count. Key/value rows are never copied for fp32 (read in
// place: the window's fresh row where the slot map names one, else the cache row) and converted once
// per listed block for 16-bit dtypes, so write_back=false never copies or touches the cache. With
// write_back the fresh rows are first written into the cache (a separate parallel loop, finished
// before any task reads the cache). Cache rows are found through attention_math::kv_slot (contiguous
// or paged); an absent position (page id outside the pool) reads a row of zeros and its score is
// set to -inf, and a block with no present key is skipped like an empty one.
//
// The rows of a query block share its key list and go through it together, up to kTileRows at a time:
// scores in chunks of one vector of keys (each chunk transposed once, then four rows per pass, a chunk
// per vector FMA), a two-pass softmax per row, and P.V four rows per pass (each value chunk loaded once
// for the four).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "dinfer_kernels/attention.h"
#include "dinfer_kernels/detail/attention_math.h"
#include "dinfer_kernels/detail/host_math.h"
#include "dinfer_kernels/detail/host_rows.h"
#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"

// The 16-float vector helpers below pass vectors by value. Without AVX-512 enabled GCC warns that
// such a signature's ABI differs between ISAs; they are internal (anonymous namespace, inlined) and
// never cross a library boundary, so the warning does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace {

using attention_math::kv_offset;
using attention_math::kv_slot;
using attention_math::KvLayout;
using attention_math::KvSlot;
using attention_math::row_valid;
using attention_math::valid_len;

using host::elem_bytes;
using host::load_row;

// Element offset of [i0, i1, i2, 0] in an array with leading strides s.
int64_t offset(const int64_t (&s)[3], int64_t i0, int64_t i1, int64_t i2) {
  return i0 * s[0] + i1 * s[1] + i2 * s[2];
}

// The fresh K/V of valid window rows into the cache rows at their positions (write_back); rows of
// absent pages are not written.
void write_back_rows(const AttentionParams& p, const KvLayout& layout, int threads) {
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
    const KvSlot at = kv_slot(layout, b, static_cast<int32_t>(pos));
    if (!at.present) continue;
    for (int64_t g = 0; g < p.heads_kv; ++g) {
      std::memcpy(kc + kv_offset(p.k_cache_stride, at, g) * eb, k + offset(p.k_stride, b, w, g) * eb,
                  row_bytes);
      std::memcpy(vc + kv_offset(p.v_cache_stride, at, g) * eb, v + offset(p.v_stride, b, w, g) * eb,
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

// The row loops keep their accumulators in registers as register-wide vectors (host_math.h vreg: 16
// floats with AVX-512, 8 with AVX2, 4 with SSE2; a wider vector's accumulators would live in memory),
// four independent ones at a time: a single FMA chain would be latency-bound. A key chunk is one
// vector of keys.
constexpr int kLanes = host::kRegLanes;
using host::lane_max;
constexpr int kChains = 4;
using host::vreg;
inline vreg loadr(const float* p) { return host::loadv<vreg>(p); }
using host::storev;

using host::lane_sum;

constexpr int64_t kTileRows = 64;  // query rows whose scores are computed together

struct Keys {
  int64_t t0, t1;
};

struct Scratch {
  std::vector<const float*> key_rows, value_rows;  // [L]: fp32 row t of the task's kv head
  std::vector<float> keys, values;  // [L, D]: converted rows (16-bit dtypes only)
  std::vector<char> absent;  // [L]: key t's page is outside the pool (its rows point at `zeros`)
  std::vector<char> ready;  // [NKB]: the block's rows are set
  std::vector<int64_t> present;  // [NKB]: keys of the block that are not absent (once ready)
  std::vector<Keys> ranges;  // per listed block: its keys, empty when none is present
  std::vector<float> q;  // [kTileRows, D]: the tile's scaled queries
  std::vector<float> scores;  // [kTileRows, L + kLanes]: scores, then exps
  std::vector<float> keys_t;  // [D, kLanes]: one key chunk, transposed
  std::vector<float> acc;  // [kChains, D]
  std::vector<float> parts;  // [kTileRows, listed blocks]: exp-sum shares
  std::vector<float> maxes, sums;  // [kTileRows]: each row's max score and exp-sum
  std::vector<float> zeros;  // [D]: the output of rows that attend nothing, the rows of absent keys
  std::vector<int64_t> rows;  // the tile's valid window rows
  std::vector<char> allowed;
  std::vector<int32_t> blocks;
};

// Keys [t0, t1) of key block kb that exist: below the sequence's length L (empty at or past it).
Keys block_keys(const AttentionParams& p, int32_t kb, int32_t L) {
  const int64_t t0 = kb * p.kv_block;
  return Keys{t0, std::min<int64_t>(t0 + p.kv_block, L)};
}

// Sets the row pointers of key block kb: fp32 rows are read in place (the window's fresh row where
// `slot` names one, else the cache row), 16-bit rows are converted into the scratch once; absent
// keys point at the zero row. Returns the block's present keys.
int64_t prepare_block(const AttentionParams& p, const KvLayout& layout, const int32_t* slot, int64_t b,
                      int64_t g, int32_t L, int32_t kb, Scratch& s) {
  if (s.ready[kb]) return s.present[kb];
  s.ready[kb] = 1;
  const int64_t D = p.head_dim;
  const Keys r = block_keys(p, kb, L);
  int64_t present = 0;
  for (int64_t t = r.t0; t < r.t1; ++t) {
    const KvSlot at = kv_slot(layout, b, static_cast<int32_t>(t));
    s.absent[t] = !at.present;
    if (!at.present) {
      s.key_rows[t] = s.value_rows[t] = s.zeros.data();
      continue;
    }
    ++present;
    const int32_t w = slot ? slot[b * p.cache_len + t] : -1;
    const void* kbase = w >= 0 ? p.k : p.k_cache;
    const void* vbase = w >= 0 ? p.v : p.v_cache;
    const int64_t ko = w >= 0 ? offset(p.k_stride, b, w, g) : kv_offset(p.k_cache_stride, at, g);
    const int64_t vo = w >= 0 ? offset(p.v_stride, b, w, g) : kv_offset(p.v_cache_stride, at, g);
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
  s.present[kb] = present;
  return present;
}

// Scores of the tile's n rows against keys [t0, t1) of one listed block: kLanes keys at a time, the
// chunk transposed once into keys_t and reused by every row (four rows per pass: independent FMA
// chains). Row i's scores land in sc[i * ld + t]; a chunk may write up to kLanes - 1 entries past t1.
void tile_scores(Scratch& s, int64_t D, int64_t n, int64_t t0, int64_t t1, int64_t ld) {
  float* kt = s.keys_t.data();
  const float* q = s.q.data();
  float* sc = s.scores.data();
  for (int64_t c = t0; c < t1; c += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, t1 - c);
    for (int64_t l = 0; l < kLanes; ++l) {
      const float* key = l < m ? s.key_rows[c + l] : nullptr;
      for (int64_t d = 0; d < D; ++d) kt[d * kLanes + l] = key ? key[d] : 0.f;
    }
    int64_t i = 0;
    for (; i + kChains <= n; i += kChains) {
      const float *q0 = q + i * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
      vreg a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t d = 0; d < D; ++d) {
        const vreg k = loadr(kt + d * kLanes);
        a0 += q0[d] * k;
        a1 += q1[d] * k;
        a2 += q2[d] * k;
        a3 += q3[d] * k;
      }
      storev(sc + i * ld + c, a0);
      storev(sc + (i + 1) * ld + c, a1);
      storev(sc + (i + 2) * ld + c, a2);
      storev(sc + (i + 3) * ld + c, a3);
    }
    for (; i < n; ++i) {
      const float* q0 = q + i * D;
      vreg a0 = {};
      for (int64_t d = 0; d < D; ++d) a0 += q0[d] * loadr(kt + d * kLanes);
      storev(sc + i * ld + c, a0);
    }
  }
}

void attend_head(const AttentionParams& p, const KvLayout& layout, const int32_t* slot, int64_t b, int64_t h,
                 Scratch& s) {
  const int64_t D = p.head_dim, S = p.cache_len, W = p.window;
  const int64_t Dv = D / kLanes * kLanes;  // dims [0, Dv) of P.V in vectors, the rest one by one
  const int64_t g = h / (p.heads_q / p.heads_kv);
  const int32_t L = valid_len(p.seq_lens[b], static_cast<int32_t>(S));
  const int64_t ld = L + kLanes;  // score row stride: room for a chunk's overhang
  const int64_t nkb = attention_math::cdiv(S, p.kv_block);
  const float kNegInf = -INFINITY;

  s.key_rows.resize(L);
  s.value_rows.resize(L);
  if (p.dtype != ScalarType::kFloat32) {
    s.keys.resize(static_cast<size_t>(L) * D);
    s.values.resize(static_cast<size_t>(L) * D);
  }
  s.absent.resize(L);
  s.ready.assign(nkb, 0);
  s.present.resize(nkb);
  s.q.resize(kTileRows * D);
  s.scores.resize(kTileRows * ld);
  s.keys_t.resize(D * kLanes);
  s.acc.resize(kChains * D);
  s.allowed.resize(nkb);
  s.maxes.resize(kTileRows);
  s.sums.resize(kTileRows);
  s.zeros.assign(D, 0.f);
  float* mass = p.block_mass ? p.block_mass + (b * p.heads_q + h) * nkb : nullptr;
  if (mass) std::fill(mass, mass + nkb, 0.f);
  // Padding rows and rows whose lists hold no key: output 0, lse -inf.
  const float* zeros = s.zeros.data();
  auto finish_row = [&](int64_t w, const float* o, float row_lse) {
    const int64_t at = offset(p.out_stride, b, w, h);
    host::store_row(o, D, p.dtype, p.out, at);
    if (p.lse) p.lse[(b * W + w) * p.heads_q + h] = row_lse;
  };

  const int64_t nqb = attention_math::cdiv(W, p.q_block);
  for (int64_t j = 0; j < nqb; ++j) {  // rows of a query block share its key list
    const int64_t j0 = j * p.q_block, j1 = std::min<int64_t>(j0 + p.q_block, W);
    listed_blocks(p, b, g, j, nkb, s.allowed, s.blocks);
    for (int64_t r0 = j0; r0 < j1; r0 += kTileRows) {
      const int64_t r1 = std::min<int64_t>(r0 + kTileRows, j1);
      s.rows.clear();
      for (int64_t w = r0; w < r1; ++w) {
        if (row_valid(p.positions[b * W + w], L)) {
          float* qr = &s.q[s.rows.size() * D];
          load_row(p.q, offset(p.q_stride, b, w, h), D, p.dtype, qr);
          for (int64_t d = 0; d < D; ++d) qr[d] *= p.scale;
          s.rows.push_back(w);
        } else {
          finish_row(w, zeros, kNegInf);
        }
      }
      const int64_t n = static_cast<int64_t>(s.rows.size());
      if (n == 0) continue;
      bool any_key = false;
      s.ranges.clear();
      for (int32_t kb : s.blocks) {
        Keys r = block_keys(p, kb, L);
        const int64_t present = r.t0 < r.t1 ? prepare_block(p, layout, slot, b, g, L, kb, s) : 0;
        if (present == 0) r.t1 = r.t0;  // no key, or only absent ones
        s.ranges.push_back(r);
        if (r.t0 >= r.t1) continue;
        tile_scores(s, D, n, r.t0, r.t1, ld);
        if (present < r.t1 - r.t0) {  // absent keys are never attended
          for (int64_t i = 0; i < n; ++i)
            for (int64_t t = r.t0; t < r.t1; ++t)
              if (s.absent[t]) s.scores[i * ld + t] = kNegInf;
        }
        any_key = true;
      }
      if (!any_key) {
        for (int64_t w : s.rows) finish_row(w, zeros, kNegInf);
        continue;
      }
      // Per row: max, then exps in place and each block's share of the exp-sum.
      const size_t nb = s.blocks.size();
      s.parts.assign(n * nb, 0.f);
      float* maxes = s.maxes.data();
      float* sums = s.sums.data();
      for (int64_t i = 0; i < n; ++i) {
        float* sc = &s.scores[i * ld];
        float m = kNegInf;
        for (const Keys& r : s.ranges)
          if (r.t0 < r.t1) m = std::max(m, lane_max(sc + r.t0, r.t1 - r.t0));
        float sum = 0.f;
        for (size_t k = 0; k < nb; ++k) {
          const Keys r = s.ranges[k];
          if (r.t0 >= r.t1) continue;
          int64_t t = r.t0;
          for (; t + host::kRegLanes <= r.t1; t += host::kRegLanes)
            host::storev(sc + t, host::exp_nonpositive(host::loadv<host::vreg>(sc + t) - m));
          for (; t < r.t1; ++t) sc[t] = host::exp_nonpositive(sc[t] - m);
          s.parts[i * nb + k] = lane_sum(sc + r.t0, r.t1 - r.t0);
          sum += s.parts[i * nb + k];
        }
        maxes[i] = m;
        sums[i] = sum;
      }
      // P.V, four rows per pass: each value chunk is loaded once for the four.
      const float* const* vr = s.value_rows.data();
      for (int64_t i0 = 0; i0 < n; i0 += kChains) {
        const int64_t nr = std::min<int64_t>(kChains, n - i0);
        const float* e[kChains];
        for (int r = 0; r < kChains; ++r) e[r] = &s.scores[(i0 + std::min<int64_t>(r, nr - 1)) * ld];
        float* acc = s.acc.data();
        for (int64_t d0 = 0; d0 < Dv; d0 += kLanes) {
          vreg a0 = {}, a1 = {}, a2 = {}, a3 = {};
          for (const Keys& r : s.ranges) {
            for (int64_t t = r.t0; t < r.t1; ++t) {
              const vreg v = loadr(vr[t] + d0);
              a0 += e[0][t] * v;
              a1 += e[1][t] * v;
              a2 += e[2][t] * v;
              a3 += e[3][t] * v;
            }
          }
          storev(acc + d0, a0);
          storev(acc + D + d0, a1);
          storev(acc + 2 * D + d0, a2);
          storev(acc + 3 * D + d0, a3);
        }
        for (int64_t d = Dv; d < D; ++d) {
          float a[kChains] = {};
          for (const Keys& r : s.ranges) {
            for (int64_t t = r.t0; t < r.t1; ++t)
              for (int c = 0; c < kChains; ++c) a[c] += e[c][t] * vr[t][d];
          }
          for (int r = 0; r < kChains; ++r) acc[r * D + d] = a[r];
        }
        for (int64_t r = 0; r < nr; ++r) {
          const int64_t i = i0 + r;
          const float inv = 1.f / sums[i];
          float* o = acc + r * D;
          for (int64_t d = 0; d < D; ++d) o[d] *= inv;
          finish_row(s.rows[i], o, maxes[i] + std::log(sums[i]));
          if (mass)
            for (size_t k = 0; k < nb; ++k) mass[s.blocks[k]] += s.parts[i * nb + k] * inv;
        }
      }
    }
  }
}

}  // namespace

void attention_cpu(const AttentionParams& p, int num_threads) {
  const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  // Without write_back the window's fresh rows stand in for their cache rows: slot[b * S + t] is
  // the window row at position t, or -1. With it they are written into the cache first.
  const KvLayout layout = attention_math::kv_layout(p);
  std::vector<int32_t> slot;
  if (p.write_back) {
    write_back_rows(p, layout, threads);
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
    for (int64_t t = 0; t < tasks; ++t) attend_head(p, layout, slots, t / p.heads_q, t % p.heads_q, scratch);
  }
}

DINFER_ISA_END
}  // namespace dinfer_kernels
