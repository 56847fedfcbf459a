// Host RMSNorm: the RmsNormParams contract over host arrays.
//
// Per row: load to fp32 scratch, the sum of squares in independent lanes (vectorised), then one pass
// that scales, rounds to the dtype (the reference rounds before the weight multiply), multiplies by
// the weight and rounds again. The weight is converted to fp32 once per call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>

#include "dinfer_kernels/detail/host_math.h"
#include "dinfer_kernels/detail/host_rows.h"
#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/rms_norm.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace {

// Elements per thread below which a second thread costs more (fork / join) than it saves.
constexpr int64_t kElementsPerThread = 16384;

void norm_rows(const RmsNormParams& p, const float* __restrict w, int64_t r0, int64_t r1) {
  const int64_t D = p.dim;
  std::vector<float> scratch(static_cast<size_t>(D));
  float* __restrict row = scratch.data();
  for (int64_t r = r0; r < r1; ++r) {
    host::load_row(p.x, r * p.x_row_stride, D, p.dtype, row);
    const float mean = host::lane_sum_squares(row, D) / static_cast<float>(D);
    const float inv = 1.f / std::sqrt(mean + p.eps);
    switch (p.dtype) {  // one loop per dtype: a branch inside would keep it from vectorising
      case ScalarType::kBFloat16: {
        int64_t d = 0;
        for (; d + host::kRegLanes <= D; d += host::kRegLanes)
          host::storev(row + d, host::round_bf16(host::loadv<host::vreg>(row + d) * inv) *
                                    host::loadv<host::vreg>(w + d));
        for (; d < D; ++d) row[d] = scalar::bf16_to_float(scalar::float_to_bf16(row[d] * inv)) * w[d];
        break;
      }
      case ScalarType::kFloat16:
        for (int64_t d = 0; d < D; ++d)
          row[d] = scalar::fp16_to_float(scalar::float_to_fp16(row[d] * inv)) * w[d];
        break;
      default:
        for (int64_t d = 0; d < D; ++d) row[d] = row[d] * inv * w[d];
    }
    host::store_row(row, D, p.dtype, p.out, r * p.out_row_stride);
  }
}

}  // namespace

void rms_norm_cpu(const RmsNormParams& p, int num_threads) {
  if (p.rows <= 0 || p.dim <= 0) return;
  std::vector<float> w(static_cast<size_t>(p.dim));
  host::load_row(p.weight, 0, p.dim, p.dtype, w.data());
  const int max_threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t useful = std::max<int64_t>(1, p.rows * p.dim / kElementsPerThread);
  const int threads = static_cast<int>(std::min<int64_t>({max_threads, useful, p.rows}));
  if (threads <= 1) {
    norm_rows(p, w.data(), 0, p.rows);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    norm_rows(p, w.data(), p.rows * t / n, p.rows * (t + 1) / n);
  }
}

DINFER_ISA_END
}  // namespace dinfer_kernels
