// A C++ runtime calling the host rms_norm with raw pointers: no Python, no torch. Two bf16 rows of
// three values (the second strided by 4 elements), each scaled by the reciprocal root mean square,
// rounded to bf16, times the weight.
#include <cmath>
#include <cstdint>
#include <cstdio>

#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/rms_norm.h"

int main() {
  using namespace dinfer_kernels;
  const float rows[2][4] = {{3, 4, 0, 99}, {1, -1, 1, 99}};  // the 4th column is not part of x
  const float weight[3] = {1, 2, 0.5f};
  uint16_t x[2][4], w[3], out[2][3];
  for (int r = 0; r < 2; ++r)
    for (int d = 0; d < 4; ++d) x[r][d] = scalar::float_to_bf16(rows[r][d]);
  for (int d = 0; d < 3; ++d) w[d] = scalar::float_to_bf16(weight[d]);
  RmsNormParams p;
  p.rows = 2;
  p.dim = 3;
  p.dtype = ScalarType::kBFloat16;
  p.x = x;
  p.x_row_stride = 4;
  p.weight = w;
  p.out = out;
  p.out_row_stride = 3;
  p.eps = 1e-6f;
  rms_norm_cpu(p, 1);
  for (int r = 0; r < 2; ++r) {
    const double ms = (rows[r][0] * rows[r][0] + rows[r][1] * rows[r][1] + rows[r][2] * rows[r][2]) / 3;
    for (int d = 0; d < 3; ++d) {
      const double want = rows[r][d] / std::sqrt(ms + 1e-6) * weight[d];
      const double got = scalar::bf16_to_float(out[r][d]);
      if (std::fabs(got - want) > 1e-2 * (1 + std::fabs(want))) {  // two bf16 roundings
        std::printf("row %d dim %d: %f, want %f\n", r, d, got, want);
        return 1;
      }
    }
  }
  std::printf("OK\n");
  return 0;
}
