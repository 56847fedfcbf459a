// The PTX the tensor-core kernels (attention.cu, moe.cu) are written on: cp.async copies into shared
// memory, ldmatrix fragment loads, the mma.m16n8k16 products and the packing of two fp32 values
// into one b16x2 register, per element format (dtype_tags.h). The fragment layouts these follow, and
// every address the kernels hand them, are in dinfer_kernels/detail/mma_layout.h.
//
// Device code only. nvcc's host pass compiles these bodies too; the #else branches only keep it
// quiet and never run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

#include "dinfer_kernels/detail/dtype_tags.h"

namespace dinfer_kernels {
namespace ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
#else
  (void)p;
  return 0;
#endif
}

// 16-byte global -> shared copy, .cg: a tile is used once per CTA, so it stays out of L1.
// pred == false zero-fills the destination and reads nothing.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(pred ? 16 : 0)
               : "memory");
#else
  (void)smem, (void)gmem, (void)pred;
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ldmatrix .x4 (no transpose). Lane l supplies the shared address of row (l % 8) of 8x8 matrix
// l / 8 (each row 16 contiguous bytes = 8 b16 elements). Result register r[m] of lane l holds
// elements (row l / 4, columns 2 * (l % 4) and 2 * (l % 4) + 1) of matrix m, the lower column in
// the low 16 bits.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_addr) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
#else
  (void)row_addr;
  r[0] = r[1] = r[2] = r[3] = 0;
#endif
}

// ldmatrix .x4 .trans: same addressing; r[m] of lane l holds elements (rows 2 * (l % 4) and
// 2 * (l % 4) + 1, column l / 4) of matrix m -- i.e. the non-transposed result of the transpose.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_addr) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
#else
  (void)row_addr;
  r[0] = r[1] = r[2] = r[3] = 0;
#endif
}

// D = A * B + D, m16n8k16, fp32 accumulators. Fragments (PTX ISA "Matrix Fragments for mma.m16n8k16
// with floating point type"; g = lane / 4, t = lane % 4; a b32 register packs two b16 elements,
// the lower column / k index in the low half):
//   A (16x16, row-major): a[0] = A[g][2t..2t+1],   a[1] = A[g+8][2t..2t+1],
//                         a[2] = A[g][2t+8..+9],   a[3] = A[g+8][2t+8..+9]
//   B (16x8, "col"):      b0 = B[2t..2t+1][g],     b1 = B[2t+8..2t+9][g]
//   C/D (16x8 fp32):      d[0] = D[g][2t], d[1] = D[g][2t+1], d[2] = D[g+8][2t], d[3] = D[g+8][2t+1]
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          dtype::BF16Tag) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)d, (void)a, (void)b0, (void)b1;
#endif
}

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                          dtype::F16Tag) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)d, (void)a, (void)b0, (void)b1;
#endif
}

// Two floats -> two b16 elements, `lo` in the low half (round to nearest even).
__device__ __forceinline__ uint32_t pack2(float lo, float hi, dtype::BF16Tag) {
#if defined(__CUDA_ARCH__)
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo (low half), .y = hi
  uint32_t u;
  memcpy(&u, &h, sizeof u);
  return u;
#else
  (void)lo, (void)hi;
  return 0;
#endif
}

__device__ __forceinline__ uint32_t pack2(float lo, float hi, dtype::F16Tag) {
#if defined(__CUDA_ARCH__)
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &h, sizeof u);
  return u;
#else
  (void)lo, (void)hi;
  return 0;
#endif
}

}  // namespace ptx
}  // namespace dinfer_kernels
