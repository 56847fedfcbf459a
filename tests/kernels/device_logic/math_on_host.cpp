// The scalar functions shared by the host and device kernels, mapped over arrays for
// tests/kernels/test_device_logic.py (the same inline code both backends compile).
#include <cstdint>

#include "dinfer_kernels/detail/moe_math.h"
#include "dinfer_kernels/detail/scalar.h"

extern "C" void dinfer_shared_math(int32_t fn, const float* x, const float* y, float* out, int64_t n) {
  using namespace dinfer_kernels;
  for (int64_t i = 0; i < n; ++i) {
    switch (fn) {
      case 0:
        out[i] = scalar::exp_nonpositive(x[i]);
        break;
      case 1:
        out[i] = moe_math::sigmoid(x[i]);
        break;
      default:
        out[i] = moe_math::silu_mul(x[i], y[i]);
        break;
    }
  }
}
