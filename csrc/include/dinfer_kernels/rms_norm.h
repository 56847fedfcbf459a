// RMSNorm over rows: torch-free launcher.
//
// Contract: dinfer_kernels/reference/rms_norm.py (the torch reference is the truth):
//     out = round(round(x * rsqrt(mean(x^2) + eps)) * weight)
// with the statistic and the products in fp32 and `round` to the arrays' dtype (a no-op for fp32):
// the normalised row is rounded before the weight multiply, as the released models do.
#pragma once

#include <cstdint>

#include "dinfer_kernels/types.h"

namespace dinfer_kernels {

// Strides are in elements; every row's D elements are contiguous.
struct RmsNormParams {
  int64_t rows = 0;  // N
  int64_t dim = 0;  // D
  ScalarType dtype = ScalarType::kBFloat16;  // of x, weight and out
  const void* x = nullptr;  // [N, D]
  int64_t x_row_stride = 0;
  const void* weight = nullptr;  // [D], contiguous
  void* out = nullptr;  // [N, D], may alias x (each row is read before it is written)
  int64_t out_row_stride = 0;
  float eps = 1e-6f;  // > 0
};

// Host launcher: rows split across num_threads OpenMP threads (0: OpenMP's default) when the call is
// large enough to pay for them; each row is computed by one thread, so the result does not depend on
// the thread count.
void rms_norm_cpu(const RmsNormParams& p, int num_threads);

}  // namespace dinfer_kernels
