// Scalar math of the MoE kernels shared by host and device code: dtype conversions with the
// rounding torch uses (round to nearest even), the router's scoring functions (on the shared
// scalar::exp_nonpositive) and tie rule, and the SiLU-times-up step. Kept separate so a host test runs exactly what the GPU runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/types.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace moe_math {

using scalar::bf16_to_float;
using scalar::bits_to_float;
using scalar::float_to_bf16;
using scalar::float_to_bits;
using scalar::float_to_fp16;
using scalar::fp16_to_float;

// ---- router ---------------------------------------------------------------------------------------

// b beats a: a larger score, or an equal score at a lower index (NaN never beats).
DINFER_HD bool beats(float bv, int32_t bi, float av, int32_t ai) { return bv > av || (bv == av && bi < ai); }

using scalar::exp_nonpositive;

// exp(l - m) of the softmax router (m = the token's max logit, so the argument is <= 0).
DINFER_HD float router_exp(float l, float m) { return exp_nonpositive(l - m); }

// 1 / (1 + exp(-x)) through exp(-|x|) <= 1: the shared exp never overflows, and x < 0 keeps its
// relative precision (e / (1 + e)) instead of rounding 1 + exp(-x) first.
DINFER_HD float sigmoid(float x) {
  const float e = exp_nonpositive(x >= 0.f ? -x : x);
  return (x >= 0.f ? 1.f : e) / (1.f + e);
}

// A selection score as the top-k sees it: NaN ranks like -inf, so every candidate stays selectable.
DINFER_HD float rankable(float x) { return x != x ? -INFINITY : x; }

// A group's score for the grouped top-k: the sum of its two best selection scores (the one score of
// a single-expert group), ranked like the scores themselves.
DINFER_HD float group_score(const float* sel, int64_t size) {
  float b1 = -INFINITY, b2 = -INFINITY;
  for (int64_t j = 0; j < size; ++j) {
    const float x = sel[j];
    if (x > b1) {
      b2 = b1;
      b1 = x;
    } else if (x > b2) {
      b2 = x;
    }
  }
  return rankable(size >= 2 ? b1 + b2 : b1);
}

// ---- expert MLP -------------------------------------------------------------------------------

// silu(g) * u = g * sigmoid(g) * u in fp32 (g and u already rounded to the compute dtype, like the
// reference's GEMM output); the caller rounds the product to the dtype. Same exp(-|g|) form as sigmoid.
DINFER_HD float silu_mul(float g, float u) {
  const float e = exp_nonpositive(g >= 0.f ? -g : g);
  return (g >= 0.f ? g : g * e) / (1.f + e) * u;
}

}  // namespace moe_math
DINFER_ISA_END
}  // namespace dinfer_kernels
