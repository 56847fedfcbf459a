// Thread, warp and CTA primitives of the kernels' __host__ __device__ code. On the device they are the
// CUDA intrinsics. On the host they are declared only: a SIMT emulator defines them
// (tests/kernels/device_logic/simt_host.cpp runs a CTA's threads as fibers, with a barrier at every
// collective), so the tests execute the kernels' own code lane by lane. Production host code never
// reaches them: only __global__ kernels call the functions built on them.
#pragma once

#include <cmath>
#include <cstdint>

#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/types.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace simt {

constexpr unsigned kFullMask = 0xFFFFFFFFu;

#if !defined(__CUDA_ARCH__)
namespace host {  // the emulator's definitions; the semantics are those of the intrinsics below
int thread_index();  // threadIdx.x
uint32_t shfl(uint32_t v, int src_lane);  // __shfl_sync (src_lane modulo 32)
uint32_t shfl_xor(uint32_t v, int lane_mask);
uint32_t shfl_up(uint32_t v, int delta);  // a lane below delta keeps its own value
uint32_t match_any(uint32_t v);
void sync_warp();
void sync_block();
}  // namespace host
#endif

DINFER_HD int thread_index() {
#if defined(__CUDA_ARCH__)
  return static_cast<int>(threadIdx.x);
#else
  return host::thread_index();
#endif
}

DINFER_HD int32_t shfl(int32_t v, int src) {
#if defined(__CUDA_ARCH__)
  return __shfl_sync(kFullMask, v, src);
#else
  return static_cast<int32_t>(host::shfl(static_cast<uint32_t>(v), src));
#endif
}

DINFER_HD float shfl(float v, int src) {
#if defined(__CUDA_ARCH__)
  return __shfl_sync(kFullMask, v, src);
#else
  return scalar::bits_to_float(host::shfl(scalar::float_to_bits(v), src));
#endif
}

DINFER_HD int32_t shfl_xor(int32_t v, int m) {
#if defined(__CUDA_ARCH__)
  return __shfl_xor_sync(kFullMask, v, m);
#else
  return static_cast<int32_t>(host::shfl_xor(static_cast<uint32_t>(v), m));
#endif
}

DINFER_HD float shfl_xor(float v, int m) {
#if defined(__CUDA_ARCH__)
  return __shfl_xor_sync(kFullMask, v, m);
#else
  return scalar::bits_to_float(host::shfl_xor(scalar::float_to_bits(v), m));
#endif
}

DINFER_HD int32_t shfl_up(int32_t v, int d) {
#if defined(__CUDA_ARCH__)
  return __shfl_up_sync(kFullMask, v, d);
#else
  return static_cast<int32_t>(host::shfl_up(static_cast<uint32_t>(v), d));
#endif
}

DINFER_HD uint32_t match_any(int32_t v) {
#if defined(__CUDA_ARCH__)
  return __match_any_sync(kFullMask, v);
#else
  return host::match_any(static_cast<uint32_t>(v));
#endif
}

DINFER_HD void sync_warp() {
#if defined(__CUDA_ARCH__)
  __syncwarp();
#else
  host::sync_warp();
#endif
}

DINFER_HD void sync_block() {
#if defined(__CUDA_ARCH__)
  __syncthreads();
#else
  host::sync_block();
#endif
}

DINFER_HD int popc(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// Warp reductions, butterflies: every lane ends with the result, and the order is fixed (deterministic).
DINFER_HD float warp_max(float v) {
  DINFER_UNROLL
  for (int off = 16; off > 0; off /= 2) v = fmaxf(v, shfl_xor(v, off));
  return v;
}

DINFER_HD float warp_sum(float v) {
  DINFER_UNROLL
  for (int off = 16; off > 0; off /= 2) v += shfl_xor(v, off);
  return v;
}

// A load of data written by other CTAs of the same launch: through L2, never a stale L1 line.
template <class T>
DINFER_HD T load_cg(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  return *p;
#endif
}

// The emulator runs one CTA at a time on one host thread: a plain add is atomic there.
DINFER_HD int32_t atomic_add(int32_t* p, int32_t v) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(p, v);
#else
  const int32_t old = *p;
  *p = old + v;
  return old;
#endif
}

DINFER_HD void threadfence() {
#if defined(__CUDA_ARCH__)
  __threadfence();
#endif
}

}  // namespace simt
DINFER_ISA_END
}  // namespace dinfer_kernels
