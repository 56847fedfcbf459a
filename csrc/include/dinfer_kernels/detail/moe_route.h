// Routing and alignment of the CUDA MoE kernel (csrc/moe/moe.cu, route_kernel) after the router
// logits: per-token scoring and grouped top-k with one warp per token, and the last CTA's alignment
// (per-expert counts, padded tile offsets, the token-ordered entry list). __host__ __device__ code on
// the simt.h primitives, so tests/kernels/device_logic/ runs it lane by lane on the host.
#pragma once

#include <cmath>
#include <cstdint>

#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/moe_math.h"
#include "dinfer_kernels/detail/simt.h"
#include "dinfer_kernels/moe.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace moe_route {

// Best (score, index) of the warp under moe_math::beats; every lane ends with the same pair since
// beats is a strict total order on pairs with distinct indices.
DINFER_HD void warp_argmax(float& v, int32_t& i) {
  DINFER_UNROLL
  for (int off = 16; off > 0; off /= 2) {
    const float ov = simt::shfl_xor(v, off);
    const int32_t oi = simt::shfl_xor(i, off);
    if (moe_math::beats(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

constexpr int kRouteThreads = 256;
constexpr int kRouteWarps = kRouteThreads / 32;
constexpr int kRouteExpertsPerWarp = 2;
constexpr int kRouteExpertsPerCta = kRouteWarps * kRouteExpertsPerWarp;  // 16
constexpr int kScoresPerLane = static_cast<int>(kMoeMaxExperts / 32);  // 16

// The best (score, index) under moe_math::beats over the warp's lane-strided scores: lane l holds
// s[i] for index l + 32 i < n; indices whose bit i is set in `skip` take no part. bi = INT32_MAX when
// none is left. Both top-k rounds (groups, then experts) pick this way.
DINFER_HD void masked_warp_argmax(const float* s, int n, uint32_t skip, int lane, float& bv, int32_t& bi) {
  bv = -INFINITY;
  bi = INT32_MAX;
  DINFER_UNROLL
  for (int i = 0; i < kScoresPerLane; ++i) {
    const int idx = lane + 32 * i;
    if (idx < n && !((skip >> i) & 1u) && moe_math::beats(s[i], idx, bv, bi)) {
      bv = s[i];
      bi = idx;
    }
  }
  warp_argmax(bv, bi);
}

constexpr float kRenormEps = 1e-20f;  // w / (sum + eps), as the reference

struct RouteArgs {
  const void* hidden;
  ScalarType hidden_dtype;
  const void* router_weight;  // null when given_logits is set
  ScalarType router_dtype;
  const float* given_logits;  // [T, E] or null
  const int32_t* given_ids;  // [T, top_k] or null: a given top-k instead of the router (no logits)
  const float* given_w;  // [T, top_k] with given_ids
  int32_t T, H, E, top_k;
  bool vec4;  // H % 4 == 0 and the hidden / router rows are aligned for 4-element loads
  MoeScoring scoring;
  bool renormalize;
  const float* bias;
  int32_t num_groups, topk_groups;
  float scaling;
  int32_t e0, e1;  // the local experts [e0, e1): w13 / w2 hold these only
  int32_t shared_experts;  // the shared expert's virtual experts (moe_experts.h), after the local ones
  int32_t bm;  // rows per M tile of the GEMMs
  // workspace
  float* logits;  // [T, E] (computed logits)
  int32_t* tile_counter;  // [token tiles], zeroed before the launch
  int32_t* done_counter;  // [1], zeroed before the launch
  int32_t* topk_ids;  // [T, top_k], increasing expert id per token
  float* topk_w;  // [T, top_k]
  int32_t* sorted_ids;  // [max_tiles * bm]: entry id or -1 (padding)
  int32_t* tile_expert;  // [max_tiles]: the expert of each M tile (moe_experts::expert_slice)
  int32_t* num_tiles;  // [1]
};

struct RouteShared {
  union {
    struct {  // scoring: per-warp scratch
      float sel[kRouteWarps][kMoeMaxExperts];  // selection scores (grouped top-k)
      float gscore[kRouteWarps][kMoeMaxExperts];  // group scores, then kept flags (1 / 0)
    } score;
    struct {  // alignment
      int32_t cnt[kRouteWarps][kMoeMaxExperts];  // per-warp counts, then per-warp bases
      int32_t total[kMoeMaxExperts];
      int32_t tile_off[kMoeMaxExperts];
    } align;
  } u;
  int32_t num_tiles;
  int32_t is_last;
};

// Token t's slots (lane j: slot j's expert and weight) sorted by expert id (ties: slot order), so that
// the combine adds them in the reference's order.
DINFER_HD void write_sorted(const RouteArgs& a, int t, int lane, int32_t my_id, float my_w) {
  int rank = 0;
  for (int j = 0; j < a.top_k; ++j) {
    const int32_t other = simt::shfl(my_id, j);
    if (other < my_id || (other == my_id && j < lane)) ++rank;
  }
  if (lane < a.top_k) {
    const int64_t o = static_cast<int64_t>(t) * a.top_k + rank;
    a.topk_ids[o] = my_id;
    a.topk_w[o] = my_w;
  }
}

// Scores one token with one warp and writes its top-k sorted by expert id.
DINFER_HD void score_token(const RouteArgs& a, RouteShared& sh, int t, int warp, int lane) {
  const int E = a.E;
  float logit[kScoresPerLane];
  const float* lrow = a.given_logits != nullptr ? a.given_logits + static_cast<int64_t>(t) * E
                                                : a.logits + static_cast<int64_t>(t) * E;
  DINFER_UNROLL
  for (int i = 0; i < kScoresPerLane; ++i) {
    const int e = lane + 32 * i;
    // Logits computed by other CTAs of this launch: read through L2 (__ldcg), never a stale L1 line.
    logit[i] = e < E ? (a.given_logits != nullptr ? lrow[e] : simt::load_cg(lrow + e)) : -INFINITY;
  }

  // sel: what the top-k ranks; wsrc: what becomes the weight (before renormalisation and scaling).
  float sel[kScoresPerLane], wsrc[kScoresPerLane];
  if (a.scoring == MoeScoring::kSoftmax) {
    float m = -INFINITY;
    DINFER_UNROLL
    for (int i = 0; i < kScoresPerLane; ++i) m = fmaxf(m, logit[i]);
    m = simt::warp_max(m);
    if (m == -INFINITY) m = 0.f;  // every logit -inf: keep exp() finite (the output is NaN anyway)
    float z = 0.f;
    DINFER_UNROLL
    for (int i = 0; i < kScoresPerLane; ++i) {
      sel[i] = lane + 32 * i < E ? moe_math::router_exp(logit[i], m) : 0.f;
      z += sel[i];
    }
    const float inv_z = 1.f / simt::warp_sum(z);  // a multiply by the reciprocal, as torch and the host
    DINFER_UNROLL
    for (int i = 0; i < kScoresPerLane; ++i) {
      const int e = lane + 32 * i;
      const float p = sel[i] * inv_z;
      sel[i] = e < E && a.bias != nullptr ? p + a.bias[e] : p;
      wsrc[i] = sel[i];  // softmax: the bias stays in the weights
    }
  } else {
    DINFER_UNROLL
    for (int i = 0; i < kScoresPerLane; ++i) {
      const int e = lane + 32 * i;
      const float s = moe_math::sigmoid(logit[i]);
      wsrc[i] = s;  // sigmoid: the weights are the unbiased scores
      sel[i] = e < E && a.bias != nullptr ? s + a.bias[e] : s;
    }
  }
  DINFER_UNROLL
  for (int i = 0; i < kScoresPerLane; ++i) sel[i] = moe_math::rankable(sel[i]);

  // Experts outside the kept groups are excluded (bit i of the lane's mask: expert lane + 32 i).
  uint32_t excluded = 0;
  if (a.num_groups > 1) {
    const int G = a.num_groups, gs = E / G;
    float* s_sel = sh.u.score.sel[warp];
    float* s_g = sh.u.score.gscore[warp];
    DINFER_UNROLL
    for (int i = 0; i < kScoresPerLane; ++i)
      if (lane + 32 * i < E) s_sel[lane + 32 * i] = sel[i];
    simt::sync_warp();
    for (int g = lane; g < G; g += 32) s_g[g] = moe_math::group_score(s_sel + g * gs, gs);
    simt::sync_warp();
    float gsc[kScoresPerLane];
    DINFER_UNROLL
    for (int i = 0; i < kScoresPerLane; ++i) gsc[i] = lane + 32 * i < G ? s_g[lane + 32 * i] : 0.f;
    uint32_t kept = 0;
    for (int r = 0; r < a.topk_groups; ++r) {
      float bv;
      int32_t bi;
      masked_warp_argmax(gsc, G, kept, lane, bv, bi);
      if (bi != INT32_MAX && bi % 32 == lane) kept |= 1u << (bi / 32);
    }
    simt::sync_warp();  // every lane has read its group scores: the array now holds kept flags
    DINFER_UNROLL
    for (int i = 0; i < kScoresPerLane; ++i)
      if (lane + 32 * i < G) s_g[lane + 32 * i] = (kept >> i) & 1u ? 1.f : 0.f;
    simt::sync_warp();
    DINFER_UNROLL
    for (int i = 0; i < kScoresPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E && s_g[e / gs] == 0.f) excluded |= 1u << i;
    }
    simt::sync_warp();  // the scratch is reused by this warp's next token
  }

  // Top-k: k rounds of a warp argmax (ties: lower expert). Lane j keeps slot j.
  uint32_t chosen = 0;
  int32_t my_id = -1;
  float my_w = 0.f;
  for (int j = 0; j < a.top_k; ++j) {
    float bv;
    int32_t bi;
    masked_warp_argmax(sel, E, chosen | excluded, lane, bv, bi);
    float w = 0.f;
    if (bi != INT32_MAX && bi % 32 == lane) {
      const int slot = bi / 32;
      chosen |= 1u << slot;
      DINFER_UNROLL
      for (int i = 0; i < kScoresPerLane; ++i)
        if (i == slot) w = wsrc[i];
    }
    const int owner = bi != INT32_MAX ? bi % 32 : 0;
    w = simt::shfl(w, owner);
    if (lane == j) {
      my_id = bi != INT32_MAX ? bi : -1;  // -1: no candidate left (excluded by the checks)
      my_w = w;
    }
  }
  if (a.renormalize) {
    float s = 0.f;  // in slot (selection) order, like a sum over the top-k dimension
    for (int j = 0; j < a.top_k; ++j) s += simt::shfl(my_w, j);
    my_w = my_w / (s + kRenormEps);
  }
  my_w = my_w * a.scaling;

  write_sorted(a, t, lane, my_id, my_w);
}

// A given top-k's token t with one warp (lane j holds slot j).
DINFER_HD void take_token(const RouteArgs& a, int t, int lane) {
  const int64_t at = static_cast<int64_t>(t) * a.top_k;
  const int32_t my_id = lane < a.top_k ? a.given_ids[at + lane] : -1;
  const float my_w = lane < a.top_k ? a.given_w[at + lane] : 0.f;
  write_sorted(a, t, lane, my_id, my_w);
}

// The entries [begin, end) of warp `warp`, walked 32 at a time: key = the expert of the kernels' list
// (a local expert, or a virtual expert of the shared expert) or -1. The routed entries t * top_k + slot
// come first, then the T entries of each virtual expert (moe_experts::virtual_entry).
DINFER_HD int32_t entry_key(const RouteArgs& a, int64_t i, int64_t end) {
  if (i >= end) return -1;
  const int64_t routed = static_cast<int64_t>(a.T) * a.top_k;
  if (i >= routed) return a.e1 - a.e0 + static_cast<int32_t>((i - routed) / a.T);
  const int32_t id = simt::load_cg(a.topk_ids + i);
  return id >= a.e0 && id < a.e1 ? id - a.e0 : -1;
}

// Counts, tile offsets and the token-ordered, padded entry list (one CTA), of the local experts and
// then of the shared expert's virtual ones.
DINFER_HD void align_entries(const RouteArgs& a, RouteShared& sh, int warp, int lane) {
  const int El = a.e1 - a.e0 + a.shared_experts;  // the experts of the list (<= kMoeMaxExperts)
  const int64_t n = static_cast<int64_t>(a.T) * (a.top_k + a.shared_experts);
  const int64_t per = (n + kRouteWarps * 32 - 1) / (kRouteWarps * 32) * 32;
  const int64_t begin = warp * per < n ? warp * per : n;
  const int64_t end = begin + per < n ? begin + per : n;
  int32_t* cnt = sh.u.align.cnt[warp];
  const uint32_t lt_mask = (1u << lane) - 1u;

  for (int el = lane; el < El; el += 32) cnt[el] = 0;
  simt::sync_warp();
  for (int64_t base = begin; base < end; base += 32) {
    const int32_t key = entry_key(a, base + lane, end);
    const uint32_t peers = simt::match_any(key);
    if (key >= 0 && (peers & lt_mask) == 0) cnt[key] += simt::popc(peers);
    simt::sync_warp();
  }
  simt::sync_block();

  // Per expert: exclusive prefix over the warps (each warp's base), and the total.
  for (int el = simt::thread_index(); el < El; el += kRouteThreads) {
    int32_t running = 0;
    for (int w = 0; w < kRouteWarps; ++w) {
      const int32_t c = sh.u.align.cnt[w][el];
      sh.u.align.cnt[w][el] = running;
      running += c;
    }
    sh.u.align.total[el] = running;
  }
  simt::sync_block();

  // Tile offsets: exclusive scan of ceil(count / bm) over the local experts (warp 0).
  if (warp == 0) {
    int32_t carry = 0;
    for (int base = 0; base < El; base += 32) {
      const int el = base + lane;
      const int32_t tiles = el < El ? (sh.u.align.total[el] + a.bm - 1) / a.bm : 0;
      int32_t incl = tiles;
      DINFER_UNROLL
      for (int off = 1; off < 32; off *= 2) {
        const int32_t o = simt::shfl_up(incl, off);
        if (lane >= off) incl += o;
      }
      if (el < El) sh.u.align.tile_off[el] = carry + incl - tiles;
      carry += simt::shfl(incl, 31);
    }
    if (lane == 0) sh.num_tiles = carry;
  }
  simt::sync_block();

  // Tile experts and padding rows.
  for (int el = simt::thread_index(); el < El; el += kRouteThreads) {
    const int32_t total = sh.u.align.total[el];
    const int32_t off = sh.u.align.tile_off[el];
    const int32_t tiles = (total + a.bm - 1) / a.bm;
    for (int32_t j = 0; j < tiles; ++j) a.tile_expert[off + j] = el;
    for (int32_t r = total; r < tiles * a.bm; ++r) a.sorted_ids[static_cast<int64_t>(off) * a.bm + r] = -1;
  }
  if (simt::thread_index() == 0) *a.num_tiles = sh.num_tiles;

  // Entries in increasing index order within each expert.
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const int32_t key = entry_key(a, i, end);
    const uint32_t peers = simt::match_any(key);
    if (key >= 0) {
      const int64_t pos =
          static_cast<int64_t>(sh.u.align.tile_off[key]) * a.bm + cnt[key] + simt::popc(peers & lt_mask);
      a.sorted_ids[pos] = static_cast<int32_t>(i);
    }
    simt::sync_warp();
    if (key >= 0 && (peers & lt_mask) == 0) cnt[key] += simt::popc(peers);
    simt::sync_warp();
  }
}

// Tokens per routing CTA (the template argument TT below).
DINFER_HD int tokens_per_cta(int64_t num_tokens) { return num_tokens > 256 ? 16 : 4; }

// One token's routing: scored from its router logits, or its given top-k taken as it is.
DINFER_HD void route_token(const RouteArgs& a, RouteShared& sh, int t, int warp, int lane) {
  if (a.given_ids != nullptr) {
    take_token(a, t, lane);
  } else {
    score_token(a, sh, t, warp, lane);
  }
}

// Everything route_kernel does after the router logits exist (computed by this launch's CTAs, or
// given; or takes a given top-k instead): CTA `tile` of `num_tiles` scores its TT tokens, one warp per token; the last CTA to finish
// aligns the entries of all tokens.
template <int TT>
DINFER_HD void score_and_align(const RouteArgs& a, RouteShared& sh, int tile, int num_tiles, int warp,
                               int lane) {
  const int t0 = tile * TT;
  // At most one token per warp without the loop: with it, nvcc 13.0 spills 4 bytes of route_kernel<4>
  // for sm_100a (the same tokens, warps and order either way).
  if constexpr (TT <= kRouteWarps) {
    if (warp < TT && t0 + warp < a.T) route_token(a, sh, t0 + warp, warp, lane);
  } else {
    for (int t = t0 + warp; t < t0 + TT && t < a.T; t += kRouteWarps) route_token(a, sh, t, warp, lane);
  }

  simt::threadfence();
  simt::sync_block();
  if (simt::thread_index() == 0) sh.is_last = simt::atomic_add(a.done_counter, 1) == num_tiles - 1;
  simt::sync_block();
  if (!sh.is_last) return;
  simt::threadfence();
  align_entries(a, sh, warp, lane);
}

}  // namespace moe_route
DINFER_ISA_END
}  // namespace dinfer_kernels
