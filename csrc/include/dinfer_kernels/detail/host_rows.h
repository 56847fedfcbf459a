// Rows of fp32 / fp16 / bf16 arrays moved to and from fp32 scratch by the host kernels (attention,
// rms_norm, rope): they do their math in fp32 and round once, with torch's rounding (nearest even).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dinfer_kernels/detail/host_math.h"
#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/types.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace host {

inline size_t elem_bytes(ScalarType t) { return t == ScalarType::kFloat32 ? 4 : 2; }

typedef uint32_t vreg_u32 __attribute__((vector_size(sizeof(vreg))));
typedef uint16_t vreg_u16 __attribute__((vector_size(sizeof(vreg) / 2)));

// kRegLanes bf16 values as fp32: bf16 is the top half of an fp32, so widen and shift. The widening
// is one vpmovzxwd from memory on AVX2 / AVX-512 (GCC 12 splits __builtin_convertvector's into
// 128-bit halves plus an insert: 5 instructions per register in the decode and MoE loops).
inline vreg bf16_to_vreg(const uint16_t* h) {
#if defined(__AVX512F__)  // maskz: GCC 12 flags the plain form's undefined merge source
  const __m512i w = _mm512_maskz_cvtepu16_epi32(static_cast<__mmask16>(0xFFFF),
                                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  return (vreg)((vreg_u32)w << 16);
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  return (vreg)((vreg_u32)w << 16);
#else
  vreg_u16 v;
  std::memcpy(&v, h, sizeof v);
  return (vreg)(__builtin_convertvector(v, vreg_u32) << 16);
#endif
}

// fp32 -> bf16 bits lane-wise, as scalar::float_to_bf16 rounds (nearest even; NaN stays a quiet NaN),
// with selects instead of its branch, so that it is vector code on every ISA.
inline vreg_u32 bf16_bits(vreg x) {
  const vreg_u32 u = (vreg_u32)x;
  const vreg_u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded;
}
inline vreg round_bf16(vreg x) { return (vreg)(bf16_bits(x) << 16); }

// d contiguous elements of `src` (element offset `at`) converted to fp32 in `dst`.
inline void load_row(const void* src, int64_t at, int64_t d, ScalarType t, float* dst) {
  if (t == ScalarType::kFloat32) {
    std::memcpy(dst, static_cast<const float*>(src) + at, static_cast<size_t>(d) * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(src) + at;
  int64_t i = 0;
  if (t == ScalarType::kBFloat16) {
    for (; i + kRegLanes <= d; i += kRegLanes) storev(dst + i, bf16_to_vreg(h + i));
    for (; i < d; ++i) dst[i] = scalar::bf16_to_float(h[i]);
    return;
  }
#if defined(__F16C__)  // eight exact conversions per instruction
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
  int64_t i = 0;
  if (t == ScalarType::kBFloat16) {
    for (; i + kRegLanes <= d; i += kRegLanes) {
      const vreg_u16 v = __builtin_convertvector(bf16_bits(loadv<vreg>(src + i)), vreg_u16);
      std::memcpy(h + i, &v, sizeof v);
    }
    for (; i < d; ++i) h[i] = scalar::float_to_bf16(src[i]);
    return;
  }
#if defined(__F16C__)  // eight conversions per instruction, round to nearest even
  for (; i + 8 <= d; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < d; ++i) h[i] = scalar::float_to_fp16(src[i]);
}

// Elements [i, i + kRegLanes) of a T array as one fp32 register (exact conversions).
template <ScalarType T>
inline vreg load_vreg(const void* src, int64_t i) {
  if (T == ScalarType::kFloat32) return loadv<vreg>(static_cast<const float*>(src) + i);
  const uint16_t* h = static_cast<const uint16_t*>(src) + i;
  if (T == ScalarType::kBFloat16) return bf16_to_vreg(h);
  float f[kRegLanes];
  load_row(h, 0, kRegLanes, T, f);  // fp16: F16C where the ISA has it
  return loadv<vreg>(f);
}

}  // namespace host
DINFER_ISA_END
}  // namespace dinfer_kernels
