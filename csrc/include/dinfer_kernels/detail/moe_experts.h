// Where the MoE kernels find an expert's weights: the routed local experts, the shared expert as
// "virtual experts" (slices of its intermediate columns, read in place), the (token, slot) entries
// they compute, and the FP8 (e4m3fn, 128 x 128 block scales) weight decoding. __host__ __device__
// code shared by the CUDA kernel (csrc/moe/moe.cu), the host kernel (csrc/moe/moe_cpu.cpp) and the
// host tests of the device logic (tests/kernels/device_logic/).
#pragma once

#include <cmath>
#include <cstdint>

#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/moe.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace moe_experts {

DINFER_HD int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- FP8 weights -------------------------------------------------------------------------------
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN. Every
// value is exact in fp16 with the exponent bias moved by 8, subnormals included (the low 7 bits
// shifted into an fp16's exponent and mantissa fields make an fp16 of the same significand whose
// exponent is 8 less: fp16 subnormals are 2^-24 m, e4m3 ones 2^-9 m / 8), so one exact fp16 -> fp32
// conversion (one cvt on the GPU) and a multiply by 2^8 decode it.
DINFER_HD float fp8_e4m3_to_float(uint8_t q) {
  const uint32_t mag = q & 0x7Fu;
  const float v = mag == 0x7Fu ? NAN : scalar::fp16_to_float(static_cast<uint16_t>(mag << 7)) * 256.f;
  return q & 0x80u ? -v : v;
}

// The dequantised weight of the contract: the fp32 product q * scale (rounded to the activation
// dtype by the caller, once).
DINFER_HD float fp8_dequant(uint8_t q, float scale) { return fp8_e4m3_to_float(q) * scale; }

// ---- experts and their slices -------------------------------------------------------------------
// The shared expert of intermediate size S runs as ceil(S / I) virtual experts of width I (the last
// one narrower) after the E_local routed ones: virtual expert j owns the intermediate columns
// [j I, j I + width) of the shared expert, i.e. its gate rows j I.., its up rows S + j I.. of
// shared_w13 and the columns j I.. of shared_w2 (row stride S). No weight is copied.
DINFER_HD int32_t num_virtual(int64_t shared_inter, int64_t inter) {
  return shared_inter > 0 ? static_cast<int32_t>(cdiv(shared_inter, inter)) : 0;
}

// One expert's weights for the two GEMMs: [g; u] = W13 x over the `width` intermediate columns
// [first, first + width) of an expert of intermediate size `inter`, and W2 a over the same columns.
struct ExpertSlice {
  bool shared;  // reads shared_w13 / shared_w2 (and their scales), else w13 / w2
  int64_t gate_at;  // element offset of its first gate row in (shared_)w13 (rows of H)
  int64_t up_at;  // element offset of its first up row
  int64_t down_at;  // element offset of row 0, column `first` of (shared_)w2
  int64_t down_ld;  // the row stride of (shared_)w2: inter
  int64_t first, width, inter;
  int64_t s13_at, s2_at;  // offset of the expert's block-scale grid in (shared_)w13_scale / w2_scale
};

// Slice [first, first + width) of an expert of intermediate size `inter` whose w13 starts at element
// w13_at and w2 at w2_at, scale grids at s13_at / s2_at (hidden size H).
DINFER_HD ExpertSlice slice_of(bool shared, int64_t first, int64_t width, int64_t inter, int64_t H,
                               int64_t w13_at, int64_t w2_at, int64_t s13_at, int64_t s2_at) {
  ExpertSlice s;
  s.shared = shared;
  s.gate_at = w13_at + first * H;
  s.up_at = w13_at + (inter + first) * H;
  s.down_at = w2_at + first;
  s.down_ld = inter;
  s.first = first;
  s.width = width;
  s.inter = inter;
  s.s13_at = s13_at;
  s.s2_at = s2_at;
  return s;
}

// Expert x of the kernels' list: the local experts [0, E_local), then the shared expert's virtual
// experts [E_local, E_local + num_virtual(S, I)).
DINFER_HD ExpertSlice expert_slice(int64_t x, int64_t local_experts, int64_t H, int64_t I, int64_t S) {
  const int64_t cb = cdiv(H, kMoeFp8Block);
  if (x < local_experts) {
    const int64_t ci = cdiv(I, kMoeFp8Block);
    return slice_of(false, 0, I, I, H, x * 2 * I * H, x * H * I, x * 2 * ci * cb, x * cb * ci);
  }
  const int64_t first = (x - local_experts) * I;
  const int64_t width = S - first < I ? S - first : I;
  return slice_of(true, first, width, S, H, 0, 0, 0, 0);
}

// Index into the (shared_)w13 scales of element k of the slice's gate (up = false) or up row n: the
// row's part (w13_scale_row) plus the column block k / 128.
DINFER_HD int64_t w13_scale_row(const ExpertSlice& s, bool up, int64_t n, int64_t H) {
  const int64_t row_block = (up ? cdiv(s.inter, kMoeFp8Block) : 0) + (s.first + n) / kMoeFp8Block;
  return s.s13_at + row_block * cdiv(H, kMoeFp8Block);
}
DINFER_HD int64_t w13_scale_index(const ExpertSlice& s, bool up, int64_t n, int64_t k, int64_t H) {
  return w13_scale_row(s, up, n, H) + k / kMoeFp8Block;
}

// Index into the (shared_)w2 scales of row h, slice column n: the row's part (w2_scale_row) plus the
// column block (first + n) / 128 of the whole expert's columns.
DINFER_HD int64_t w2_scale_row(const ExpertSlice& s, int64_t h) {
  return s.s2_at + (h / kMoeFp8Block) * cdiv(s.inter, kMoeFp8Block);
}
DINFER_HD int64_t w2_scale_index(const ExpertSlice& s, int64_t h, int64_t n) {
  return w2_scale_row(s, h) + (s.first + n) / kMoeFp8Block;
}

// ---- entries ------------------------------------------------------------------------------------
// The rows the expert GEMMs compute are entries: t * top_k + slot for the routed (token, slot) pairs,
// then T top_k + j T + t for token t of virtual expert j (every token takes every virtual expert).
DINFER_HD int64_t num_entries(int64_t T, int64_t top_k, int64_t virtual_experts) {
  return T * (top_k + virtual_experts);
}

DINFER_HD int64_t entry_token(int64_t entry, int64_t T, int64_t top_k) {
  const int64_t routed = T * top_k;
  return entry < routed ? entry / top_k : (entry - routed) % T;
}

// The entry of token t in virtual expert j.
DINFER_HD int64_t virtual_entry(int64_t t, int64_t j, int64_t T, int64_t top_k) {
  return T * top_k + j * T + t;
}

}  // namespace moe_experts
DINFER_ISA_END
}  // namespace dinfer_kernels
