// Exact scalar conversions and fast special functions shared by the host and device code of every
// kernel family: fp32 bit casts, bf16/fp16 <-> fp32 with torch's rounding (round to nearest even),
// and MUFU-based exp2/log2. Device code uses the PTX instructions; host code (the CPU kernels and
// the host-side launchers) uses the bit-exact equivalents.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/types.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace scalar {

// log2(e) and ln(2) in fp32, for the kernels that work in the exp2 domain.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

DINFER_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

DINFER_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// ---- 16-bit formats ------------------------------------------------------------------------------

DINFER_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet), infinities and overflow to inf.
DINFER_HD uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  uint16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7FFFu + lsb) >> 16);
#endif
}

DINFER_HD float fp16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  const float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24, exact
  return sign ? -f : f;
#endif
}

// fp32 -> fp16, round to nearest even (subnormals included); overflow to inf, NaN stays NaN.
DINFER_HD uint16_t float_to_fp16(float f) {
#if defined(__CUDA_ARCH__)
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {  // normal half (>= 2^-14)
    const uint32_t lsb = (a >> 13) & 1u;
    const uint32_t r = (a + 0xFFFu + lsb) >> 13;  // carries into the exponent are correct
    return static_cast<uint16_t>(sign | (r - (112u << 10)));
  }
  // Subnormal half: value = m * 2^-24 with m in [0, 1024]; a float rounds to the nearest m.
  const float x = bits_to_float(a) * 16777216.0f;  // exact scaling by 2^24
  // x < 1024 here: round half to even by hand (rintf's mode is not guaranteed on the host).
  const float fl = floorf(x);
  float m = fl;
  const float diff = x - fl;
  if (diff > 0.5f || (diff == 0.5f && fmodf(fl, 2.0f) != 0.0f)) m = fl + 1.0f;
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(m));
#endif
}

// ---- exp -----------------------------------------------------------------------------------------

// exp(x) for x <= 0 (softmax arguments z - max, SiLU's and sigmoid's exp(-|x|)), the one exp that
// host and device kernels share where their results must agree: 2^n * e^r with |r| <= ln2/2,
// degree-7 Taylor (truncation < 1e-9 relative), within ~1 ulp of a correctly rounded exp. Plain
// arithmetic, so host compilers vectorise it (libm's expf does not vectorise) and the device runs the
// same formula (CUDA's expf is a different ~2-ulp approximation). Below -87.3 the result would be
// subnormal: return 0, which also maps exp(-inf) to 0 as an online softmax needs. NaN stays NaN.
DINFER_HD float exp_nonpositive(float x) {
  const float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  const float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to nearest, and vectorises
  const float xc = x < -87.3f ? -87.3f : x;
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = xc - n * kLn2Hi - n * kLn2Lo;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const float scale = bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return x < -87.3f ? 0.f : p * scale;
}

// 2^x with MUFU.EX2 alone (<= 2 ulp; results below 2^-126 flush to 0, ex2(-inf) = +0).
DINFER_HD float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// log2 with MUFU.LG2 (approximate: only for bounds that carry their own margin).
DINFER_HD float fast_log2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return log2f(x);
#endif
}

}  // namespace scalar
DINFER_ISA_END
}  // namespace dinfer_kernels
