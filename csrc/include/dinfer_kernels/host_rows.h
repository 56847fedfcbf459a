// Rows of fp32 / fp16 / bf16 arrays moved to and from fp32 scratch by the host kernels (attention,
// rms_norm, rope): they do their math in fp32 and round once, with torch's rounding (nearest even).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "dinfer_kernels/decode.h"  // ScalarType
#include "dinfer_kernels/scalar.h"
#include "dinfer_kernels/isa_namespace.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace host {

inline size_t elem_bytes(ScalarType t) { return t == ScalarType::kFloat32 ? 4 : 2; }

// d contiguous elements of `src` (element offset `at`) converted to fp32 in `dst`.
inline void load_row(const void* src, int64_t at, int64_t d, ScalarType t, float* dst) {
  if (t == ScalarType::kFloat32) {
    std::memcpy(dst, static_cast<const float*>(src) + at, static_cast<size_t>(d) * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src) + at;
  if (t == ScalarType::kBFloat16) {   // a shift per element: this loop vectorises
    for (int64_t i = 0; i < d; ++i) dst[i] = scalar::bf16_to_float(h[i]);
    return;
  }
  int64_t i = 0;
#if defined(__F16C__)   // eight exact conversions per instruction
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < d; ++i) dst[i] = scalar::fp16_to_float(h[i]);
}

// d fp32 values of `src` rounded to t into `dst` (element offset `at`).
inline void store_row(const float* src, int64_t d, ScalarType t, void* dst, int64_t at) {
  if (t == ScalarType::kFloat32) {
    std::memcpy(static_cast<float*>(dst) + at, src, static_cast<size_t>(d) * sizeof(float));
    return;
  }
  uint16_t* h = static_cast<uint16_t*>(dst) + at;
  if (t == ScalarType::kBFloat16) {
    for (int64_t i = 0; i < d; ++i) h[i] = scalar::float_to_bf16(src[i]);
    return;
  }
  int64_t i = 0;
#if defined(__F16C__)   // eight conversions per instruction, round to nearest even
  for (; i + 8 <= d; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < d; ++i) h[i] = scalar::float_to_fp16(src[i]);
}

}  // namespace host
DINFER_ISA_END
}  // namespace dinfer_kernels
