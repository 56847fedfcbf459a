// Reduction and softmax pieces of the host kernels (decode step, attention, rms_norm) written so that
// GCC/Clang vectorise them without -ffast-math: exp as a polynomial (scalar::exp_nonpositive; libm's
// expf does not vectorise), and max / sum / sum of squares in independent lanes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dinfer_kernels/scalar.h"

namespace dinfer_kernels {
namespace host {

// The exp of the host kernels' softmaxes: the one shared with the device kernels (scalar.h).
using scalar::exp_nonpositive;

constexpr int kLanes = 16;

// max of x[0, n) in kLanes independent lanes (-inf when n = 0).
inline float lane_max(const float* x, int64_t n) {
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

// 16 floats as one vector (GCC/Clang vector extensions: one AVX-512 register, or two AVX / four SSE
// ones, whatever -march allows), loaded and stored unaligned. Passed by value only between inlined
// internal functions, so GCC's note that the ABI of such signatures differs between ISAs does not
// apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float v16 __attribute__((vector_size(kLanes * sizeof(float))));
inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// Sum of x[0, n) in kLanes independent accumulators: vectorises without -ffast-math.
inline float lane_sum(const float* x, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += x[i + j];
  float total = 0.f;
  for (int j = 0; j < kLanes; ++j) total += lane[j];
  for (; i < n; ++i) total += x[i];
  return total;
}

// Sum of x[i]^2 over [0, n), in the same lanes.
inline float lane_sum_squares(const float* x, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += x[i + j] * x[i + j];
  float total = 0.f;
  for (int j = 0; j < kLanes; ++j) total += lane[j];
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

}  // namespace host
}  // namespace dinfer_kernels
