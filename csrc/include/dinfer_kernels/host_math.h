// Reduction and softmax pieces of the host kernels (decode step, attention, rms_norm) written so that
// GCC/Clang vectorise them without -ffast-math: exp as a polynomial (libm's expf does not
// vectorise), within ~1 ulp, and max / sum / sum of squares in independent lanes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dinfer_kernels/isa_namespace.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace host {

// exp(x) for x <= 0 (arguments are z - max): 2^n * e^r with |r| <= ln2/2, degree-7 Taylor
// (truncation < 1e-9 relative). Below -87.3 the result would be subnormal: return 0, which also
// maps exp(-inf) to 0 as the online softmax needs.
inline float exp_nonpositive(float x) {
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to nearest, and vectorises
  float xc = x < -87.3f ? -87.3f : x;
  float n = (xc * kLog2e + kRound) - kRound;
  float r = xc - n * kLn2Hi - n * kLn2Lo;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? 0.f : p * scale;
}

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
DINFER_ISA_END
}  // namespace dinfer_kernels
