// Per-row and per-sequence math of the decode step, shared verbatim by the CPU and CUDA kernels.
//
// Only the vocabulary pass differs between backends (SIMD loops vs. warp reductions); everything
// after it -- combining partials, the O(K) sparse-credit correction, the commit rules and the
// progress guarantee -- lives here, so the CPU tests exercise the exact code the GPU runs.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "dinfer_kernels/decode.h"
#include "dinfer_kernels/detail/dtype_tags.h"
#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace decode_math {

constexpr int32_t kNoIndex = INT32_MAX;  // "no element yet": loses every tie
constexpr float kAtLeastOneEps = 1e-5f;

// ---- scalar helpers ----------------------------------------------------------------------------

DINFER_HD float sanitize(float z) {  // NaN -> -inf, +inf -> FLT_MAX (reference step 0)
  return z != z ? -INFINITY : fminf(z, FLT_MAX);
}

// Element v of a row, as sanitised fp32.
DINFER_HD float load_logit(const void* row, ScalarType t, int64_t v) {
  return sanitize(dtype::load_float(row, t, v));
}

// b beats a: larger value, or equal value at a lower index.
DINFER_HD bool beats(float bv, int32_t bi, float av, int32_t ai) { return bv > av || (bv == av && bi < ai); }

// ---- counter-based RNG (reference/rng.py) ------------------------------------------------------

DINFER_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

DINFER_HD uint32_t row_key(uint32_t seed, uint32_t offset, uint32_t row) {
  return mix32(mix32(mix32(seed ^ 0x9E3779B9u) ^ offset) ^ row);
}

// The counter of row n in the hash: the caller's per-row key (low 32 bits), else n itself.
DINFER_HD uint32_t row_counter(const int64_t* row_keys, int64_t n) {
  return static_cast<uint32_t>(row_keys != nullptr ? row_keys[n] : n);
}

DINFER_HD float gumbel(uint32_t key, uint32_t v) {
  // 23 random bits + 0.5 fit fp32's 24-bit significand: u is exact and strictly inside (0, 1),
  // so the noise is always finite.
  float u = (static_cast<float>(mix32(key ^ v) >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

// ---- vocabulary-pass partials ------------------------------------------------------------------

// What one pass over (part of) a row keeps. score = z (T == 0) or z / T + gumbel (T > 0).
struct Partial {
  float max;  // raw max of z
  float sum;  // sum of exp(z - max)
  float score;  // best score
  float nm_score;  // best score over v != mask_id
  int32_t arg;  // raw argmax (lowest index on ties)
  int32_t score_arg;
  int32_t nm_arg;
  int32_t nonfinite;  // 1 if a raw element was NaN or +-inf (the sanitised values cannot tell)
};

DINFER_HD Partial empty_partial() {
  return Partial{-INFINITY, 0.f, -INFINITY, -INFINITY, kNoIndex, kNoIndex, kNoIndex, 0};
}

// Step 5's token when no masked row of a sequence has a fallback: the lowest id != mask_id.
DINFER_HD int64_t default_token(int64_t mask_id) { return mask_id == 0 ? 1 : 0; }

// Rescale a sum of exp(z - from) to exp(z - to), to >= from; -inf-safe.
DINFER_HD float rescale(float sum, float from, float to) {
  return from == -INFINITY ? 0.f : sum * expf(from - to);
}

DINFER_HD Partial merge(const Partial& a, const Partial& b) {
  Partial r;
  r.max = fmaxf(a.max, b.max);
  r.sum = r.max == -INFINITY ? 0.f : rescale(a.sum, a.max, r.max) + rescale(b.sum, b.max, r.max);
  bool braw = beats(b.max, b.arg, a.max, a.arg);
  r.arg = braw ? b.arg : a.arg;
  bool bs = beats(b.score, b.score_arg, a.score, a.score_arg);
  r.score = bs ? b.score : a.score;
  r.score_arg = bs ? b.score_arg : a.score_arg;
  bool bn = beats(b.nm_score, b.nm_arg, a.nm_score, a.nm_arg);
  r.nm_score = bn ? b.nm_score : a.nm_score;
  r.nm_arg = bn ? b.nm_arg : a.nm_arg;
  r.nonfinite = a.nonfinite | b.nonfinite;
  return r;
}

// Score of token v given its fused logit (what the candidate argmax ranks).
DINFER_HD float score_of(float zf, float temperature, uint32_t key, int64_t v) {
  return temperature > 0.f ? zf / temperature + gumbel(key, static_cast<uint32_t>(v)) : zf;
}

// ---- per-row finalize --------------------------------------------------------------------------

struct RowResult {
  int64_t candidate;
  float confidence;
  int64_t fallback;  // best non-mask token, default_token() if none
  float fallback_conf;  // its probability, -inf if none
};

// Steps 1-3 of the reference for one row, given the row's combined partial. Reads the logits of the
// credited tokens (O(K)), updates the row's credit slots in place. key: row_key() of the row's
// counter, formed by the caller (formed in here, ptxas spills in the finalize kernel on sm_80 or
// sm_90a). The caller also writes the row's nonfinite flag (p.nonfinite), for the same reason.
DINFER_HD RowResult finalize_row(const Partial& p, const void* row, const DecodeStepParams& prm, int64_t n,
                                 bool masked, uint32_t key) {
  RowResult r;
  const int64_t V = prm.vocab;
  const int K = prm.num_slots;
  int32_t* ids = prm.credit_ids + n * K;
  float* vals = prm.credit_vals + n * K;
  // A live row always has a valid score_arg: scores are never NaN (sanitised logits, finite noise)
  // and beats() lets even a -inf score take the index, so the logits reads below stay in bounds.
  const bool dead = p.max == -INFINITY;

  // Step 2: sparse credit. Invalid ids (outside [0, V)) are treated as empty slots, never read.
  for (int j = 0; j < K; ++j) {
    if (ids[j] < 0 || ids[j] >= V) {
      ids[j] = -1;
      vals[j] = 0.f;
    }
    vals[j] *= prm.credit_beta;
  }
  if (K > 0 && masked && !dead) {
    const float boost = powf(1.0f / p.sum, prm.credit_gamma);  // p* = softmax(z)[arg] = 1 / sum
    int hit = -1, empty = -1, weakest = 0;
    for (int j = 0; j < K; ++j) {
      if (ids[j] == p.arg && hit < 0) hit = j;
      if (ids[j] < 0 && empty < 0) empty = j;
      if (vals[j] < vals[weakest]) weakest = j;
    }
    if (hit >= 0) {
      vals[hit] += boost;
    } else {
      int s = empty >= 0 ? empty : weakest;
      ids[s] = p.arg;
      vals[s] = boost;
    }
  }
  if (dead) {
    r.candidate = prm.mask_id;
    r.confidence = 0.f;
    r.fallback = default_token(prm.mask_id);
    r.fallback_conf = -INFINITY;
    return r;
  }

  // Step 3: fused logits differ from raw ones only at credited tokens, and only upwards, so the
  // best score is either the pass's best (its raw score is a lower bound) or a credited token.
  float best = p.score, nm_best = p.nm_score, fmax = p.max;
  int64_t best_i = p.score_arg, nm_i = p.nm_arg;
  for (int j = 0; j < K; ++j) {
    if (ids[j] < 0) continue;
    const float zf = load_logit(row, prm.logits_dtype, ids[j]) + prm.credit_alpha * log1pf(vals[j]);
    const float s = score_of(zf, prm.temperature, key, ids[j]);
    if (beats(s, ids[j], best, static_cast<int32_t>(best_i))) {
      best = s;
      best_i = ids[j];
    }
    if (ids[j] != prm.mask_id && beats(s, ids[j], nm_best, static_cast<int32_t>(nm_i))) {
      nm_best = s;
      nm_i = ids[j];
    }
    fmax = fmaxf(fmax, zf);
  }
  // Sum of exp(z' - fmax): the raw sum, rescaled, with each credited term swapped for its fused one.
  float sum = rescale(p.sum, p.max, fmax);
  for (int j = 0; j < K; ++j) {
    if (ids[j] < 0) continue;
    const float z = load_logit(row, prm.logits_dtype, ids[j]);
    sum += expf(z + prm.credit_alpha * log1pf(vals[j]) - fmax) - expf(z - fmax);
  }
  auto fused_logit = [&](int64_t v) {
    float zf = load_logit(row, prm.logits_dtype, v);
    for (int j = 0; j < K; ++j)
      if (ids[j] == v) zf += prm.credit_alpha * log1pf(vals[j]);
    return zf;
  };
  r.candidate = best_i;
  r.confidence = expf(fused_logit(best_i) - fmax) / sum;
  const bool nm_ok = nm_i != kNoIndex && nm_i != prm.mask_id && fused_logit(nm_i) > -INFINITY;
  r.fallback = nm_ok ? nm_i : default_token(prm.mask_id);
  r.fallback_conf = nm_ok ? expf(fused_logit(nm_i) - fmax) / sum : -INFINITY;
  return r;
}

// ---- per-sequence commit -----------------------------------------------------------------------
// Rows of one sequence are [0, L) relative to the sequence start. `tokens` are the tokens before
// this step; candidate/confidence are the finalize_row outputs.

DINFER_HD bool is_masked(const int64_t* tokens, int64_t i, int64_t mask_id) { return tokens[i] == mask_id; }

DINFER_HD bool is_eligible(const int64_t* tokens, const int64_t* cand, int64_t i, int64_t mask_id) {
  return tokens[i] == mask_id && cand[i] != mask_id;
}

struct SeqStats {
  float max_c;  // max confidence over eligible rows (-inf if none)
  int64_t argmax_c;  // first row holding it (-1 if none)
  int64_t fallback_row;  // progress-guarantee row (-1 if not needed or impossible)
};

// can_default: the vocabulary has a token other than the mask (V >= 2), so a masked row without a
// fallback can still commit default_token(); the lowest such row is picked when no row has one.
DINFER_HD SeqStats sequence_stats(int64_t L, const int64_t* tokens, const int64_t* cand, const float* conf,
                                  const float* fb_conf, int64_t mask_id, bool can_default) {
  SeqStats s{-INFINITY, -1, -1};
  int64_t first_masked = -1;
  float best_fb = -INFINITY;
  for (int64_t i = 0; i < L; ++i) {
    if (!is_masked(tokens, i, mask_id)) continue;
    if (first_masked < 0) first_masked = i;
    if (is_eligible(tokens, cand, i, mask_id) && (s.argmax_c < 0 || conf[i] > s.max_c)) {
      s.max_c = conf[i];
      s.argmax_c = i;
    }
    if (fb_conf[i] > best_fb) {
      best_fb = fb_conf[i];
      s.fallback_row = i;
    }
  }
  // Decided after the loop, not in it: the finalize kernel's thread 0 has no register to spare.
  if (first_masked < 0 || s.argmax_c >= 0)
    s.fallback_row = -1;
  else if (s.fallback_row < 0 && can_default)
    s.fallback_row = first_masked;
  return s;
}

// Whether row i commits under the rule (the progress guarantee and the joint rule's edits excluded).
// O(L) for the rank of the fixed rule and O(run length) for the hierarchical run maximum, so rows can
// be decided in parallel.
DINFER_HD bool row_commits(int64_t i, int64_t L, const int64_t* tokens, const int64_t* cand,
                           const float* conf, const SeqStats& s, CommitRule rule, float tau, float tau_low,
                           int32_t k, int64_t mask_id) {
  if (s.argmax_c < 0 || !is_eligible(tokens, cand, i, mask_id)) return false;
  const float c = conf[i];
  if (rule == CommitRule::kThreshold || rule == CommitRule::kJoint)
    return c >= fminf(tau, s.max_c - kAtLeastOneEps);
  if (rule == CommitRule::kHierarchical) {
    if (c > tau || i == s.argmax_c) return true;
    if (!(c > tau_low)) return false;
    for (int64_t j = i - 1; j >= 0 && is_masked(tokens, j, mask_id); --j)
      if (is_eligible(tokens, cand, j, mask_id) && conf[j] > c) return false;
    for (int64_t j = i + 1; j < L && is_masked(tokens, j, mask_id); ++j)
      if (is_eligible(tokens, cand, j, mask_id) && conf[j] > c) return false;
    return true;
  }
  int64_t rank = 0;  // eligible rows ahead of i: higher confidence, or equal and earlier
  for (int64_t j = 0; j < L && rank < k; ++j)
    if (j != i && is_eligible(tokens, cand, j, mask_id) && (conf[j] > c || (conf[j] == c && j < i))) ++rank;
  return rank < k;
}

// Whether row n of the batch is rewritten by the joint rule's token-to-token editing: not masked,
// editable, a candidate that is neither the mask token (so the row is live: dead rows predict the
// mask) nor its token, with confidence > edit_threshold (+inf: never). Independent of every other
// row, so it needs no sequence statistics; masked rows never qualify, so edits and the progress
// guarantee (which changes masked rows' candidates only) never meet. token: the token before this step.
DINFER_HD bool row_edits(const DecodeStepParams& p, int64_t n, int64_t token, int64_t cand, float conf) {
  return p.rule == CommitRule::kJoint && token != p.mask_id && cand != p.mask_id && cand != token &&
         conf > p.edit_threshold && (p.editable == nullptr || p.editable[n] != 0);
}

}  // namespace decode_math
DINFER_ISA_END
}  // namespace dinfer_kernels
