// Rotary position embedding, rotate-half (NeoX) style, at each row's own position: torch-free
// launcher.
//
// Contract: dinfer_kernels/reference/rope.py (the torch reference is the truth). The angles come from
// a caller-built table, as in vLLM's cos_sin_cache: row p holds cos(p * inv_freq[j]) for
// j < rotary_dim / 2, then sin(p * inv_freq[j]), in fp32. Per head, with c, s the table row of the
// token's position and x1, x2 the two halves of the first rotary_dim dims (in fp32):
//     out1 = x1 * c - x2 * s,  out2 = x2 * c + x1 * s,  the dims past rotary_dim copied,
// rounded once to the arrays' dtype.
#pragma once

#include <cstdint>

#include "dinfer_kernels/types.h"

namespace dinfer_kernels {

// Strides are in elements; the last dimension of x and out is contiguous.
struct RopeParams {
  int64_t batch = 0;  // B
  int64_t tokens = 0;  // T
  int64_t heads = 0;  // H
  int64_t head_dim = 0;  // D
  int64_t rotary_dim = 0;  // even, 2 <= rotary_dim <= D: the first rotary_dim dims rotate
  ScalarType dtype = ScalarType::kBFloat16;  // of x and out
  const void* x = nullptr;  // [B, T, H, D]
  int64_t x_stride[3] = {0, 0, 0};
  const int64_t* positions = nullptr;  // [B, T], contiguous; each in [0, table_len)
  const float* cos_sin = nullptr;  // [table_len, rotary_dim], contiguous
  int64_t table_len = 0;
  void* out = nullptr;  // [B, T, H, D], may alias x (each head row is read, then written)
  int64_t out_stride[3] = {0, 0, 0};
};

// Host launcher: the (b, t) rows split across num_threads OpenMP threads (0: OpenMP's default) when
// the call is large enough to pay for them. Positions must have been checked against table_len by
// the caller (the Python binding does).
void rope_cpu(const RopeParams& p, int num_threads);

}  // namespace dinfer_kernels
