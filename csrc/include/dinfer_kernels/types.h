// What every launcher header and every kernel source shares: the element types, the stream type and
// the two macros of code that both the host compiler and nvcc compile.
#pragma once

#include <cstdint>

// Same declaration as cuda_runtime.h, so the launcher headers need no CUDA toolkit.
typedef struct CUstream_st* cudaStream_t;

// Functions of the kernels' math that host code (the CPU kernels, the launchers, the host tests) and
// device code both call.
#if defined(__CUDACC__)
#define DINFER_HD __host__ __device__ __forceinline__
#else
#define DINFER_HD inline
#endif

// `#pragma unroll` on a line of its own before the loop it unrolls: the host compiler, which sees
// the same code, would warn about the pragma (-Wunknown-pragmas).
#if defined(__CUDA_ARCH__)
#define DINFER_UNROLL _Pragma("unroll")
#else
#define DINFER_UNROLL
#endif

namespace dinfer_kernels {

// kFloat8E4M3: float8_e4m3fn weights with fp32 block scales (the MoE layer's FP8 experts; activations are
// never fp8).
enum class ScalarType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3 };

}  // namespace dinfer_kernels
