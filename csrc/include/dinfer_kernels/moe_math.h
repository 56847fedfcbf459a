// Scalar math of the MoE kernels shared by host and device code: dtype conversions with the
// rounding torch uses (round to nearest even), the router's scoring functions and tie rule, and
// the SiLU-times-up step. Kept separate so a host test harness runs exactly what the GPU runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DINFER_MOE_HD __host__ __device__ __forceinline__
#else
#define DINFER_MOE_HD inline
#endif

namespace dinfer_kernels {
namespace moe_math {

DINFER_MOE_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
#endif
}

DINFER_MOE_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// ---- 16-bit formats ------------------------------------------------------------------------------

DINFER_MOE_HD float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet), infinities and overflow to inf.
DINFER_MOE_HD uint16_t float_to_bf16(float f) {
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

DINFER_MOE_HD float fp16_to_float(uint16_t h) {
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
DINFER_MOE_HD uint16_t float_to_fp16(float f) {
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

// ---- router ---------------------------------------------------------------------------------------

// b beats a: a larger score, or an equal score at a lower index (NaN never beats).
DINFER_MOE_HD bool beats(float bv, int32_t bi, float av, int32_t ai) {
  return bv > av || (bv == av && bi < ai);
}

DINFER_MOE_HD float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// A selection score as the top-k sees it: NaN ranks like -inf, so every candidate stays selectable.
DINFER_MOE_HD float rankable(float x) { return x != x ? -INFINITY : x; }

// ---- expert MLP -------------------------------------------------------------------------------

// silu(g) * u in fp32 (g and u already rounded to the compute dtype, like the reference's GEMM
// output); the caller rounds the product to the dtype.
DINFER_MOE_HD float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

}  // namespace moe_math
}  // namespace dinfer_kernels
