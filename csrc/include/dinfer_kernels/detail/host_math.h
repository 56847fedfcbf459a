// Reduction and softmax pieces of the host kernels (decode step, attention, rms_norm) written so that
// GCC/Clang vectorise them without -ffast-math: exp as a polynomial (scalar::exp_nonpositive; libm's
// expf does not vectorise), and max / sum / sum of squares in independent lanes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace host {

// Fixed-width float vectors (GCC/Clang vector extensions): the compiler maps each onto the widest
// registers -march allows (one AVX-512 register for 16 floats, two AVX ones, four SSE ones), so one
// source serves every ISA, and the selects below stay branch-free where a plain loop would not
// vectorise (without AVX-512's masks, GCC gives up on a loop holding a conditional). Loaded and
// stored unaligned; passed by value only between inlined internal functions, so GCC's note that the
// ABI of such signatures differs between ISAs does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v16 __attribute__((vector_size(16 * sizeof(float))));

// The vector of one hardware register. Wider vectors work on any ISA for plain arithmetic (GCC
// splits them), but their compares and selects are lowered lane by lane through memory without
// AVX-512: loops holding a select iterate on vreg.
#if defined(__AVX512F__)
typedef v16 vreg;
#elif defined(__AVX__)
typedef v8 vreg;
#else
typedef v4 vreg;
#endif
constexpr int kRegLanes = sizeof(vreg) / sizeof(float);

template <typename V>
inline V loadv(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename V>
inline void storev(float* p, V v) {
  std::memcpy(p, &v, sizeof v);
}
template <typename V>
inline V splat(float x) {
  return V{} + x;
}

// exp(xc) for xc in [-87.3, 0], lane-wise: scalar::exp_nonpositive's range reduction and polynomial
// step for step on a vector, so the host's SIMD softmaxes and the device's scalar code agree.
template <typename V>
inline V exp_in_range(V xc) {
  using Mask = decltype(xc < xc);  // the signed integer vector of the same shape
  const float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to nearest
  const V n = (xc * 1.44269504088896341f + kRound) - kRound;
  const V r = xc - n * 0.693359375f - n * -2.12194440e-4f;  // ln2 in two parts
  V p = splat<V>(1.f / 5040.f);
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
#if defined(__AVX512F__)
  // p * 2^n in one instruction instead of building 2^n's bits (convert, add, shift) and multiplying:
  // the same exact product, rounded once.
  if constexpr (sizeof(V) == sizeof(__m512))  // maskz: GCC 12 flags the plain form's undefined merge source
    return (V)_mm512_maskz_scalef_ps(static_cast<__mmask16>(0xFFFF), (__m512)p, (__m512)n);
#endif
  const Mask bits = (__builtin_convertvector(n, Mask) + 127) << 23;
  return p * (V)bits;
}

constexpr float kExpFloor = -87.3f;  // below it exp_nonpositive is 0 (2^-126 and under)

// exp(x) for x <= 0, lane-wise (NaN stays NaN).
template <typename V>
inline V exp_nonpositive(V x) {
  const V lo = splat<V>(kExpFloor);
  const auto under = x < lo;
  return under ? V{} : exp_in_range(under ? lo : x);
}

// The terms of a sum of exp(x) over x <= 0, NaN counting as 0 (a sanitised logit minus the row max,
// straight from the raw logit: NaN as -inf): exp_nonpositive's value for x >= -87.3, and below it
// (and for NaN, which compares false) exp(-87.3) <= 2^-125 instead of 0 — nothing in a
// sum that holds exp(0) = 1, the max itself. One max instead of exp_nonpositive's compare and two selects.
// x > y ? x : y lane-wise (so y where x is NaN): exactly the x86 max instruction, which GCC does not
// always see through the select (SSE2 got compare, and, andnot, or).
template <typename V>
inline V max_or_second(V x, V y) {
#if defined(__AVX512F__)  // maskz: GCC 12 flags the plain form's undefined merge source
  if constexpr (sizeof(V) == 64)
    return (V)_mm512_maskz_max_ps(static_cast<__mmask16>(0xFFFF), (__m512)x, (__m512)y);
#endif
#if defined(__AVX__)
  if constexpr (sizeof(V) == 32) return (V)_mm256_max_ps((__m256)x, (__m256)y);
#endif
#if defined(__SSE__)
  if constexpr (sizeof(V) == 16) return (V)_mm_max_ps((__m128)x, (__m128)y);
#endif
  return x > y ? x : y;
}

template <typename V>
inline V exp_term(V x) {
  return exp_in_range(max_or_second(x, splat<V>(kExpFloor)));
}

// The scalar form (loop tails, one-off values): lane 0 of the 4-lane one, so both agree exactly.
inline float exp_nonpositive(float x) { return exp_nonpositive(splat<v4>(x))[0]; }

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

inline v16 load16(const float* p) { return loadv<v16>(p); }
inline void store16(float* p, v16 v) { storev(p, v); }

// Max and sum of a vector's lanes.
template <typename V>
inline float hmax(V v) {
  float a[sizeof(V) / sizeof(float)];
  storev(a, v);
  return lane_max(a, sizeof(V) / sizeof(float));
}

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

template <typename V>
inline float hsum(V v) {
  float a[sizeof(V) / sizeof(float)];
  storev(a, v);
  return lane_sum(a, sizeof(V) / sizeof(float));
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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
