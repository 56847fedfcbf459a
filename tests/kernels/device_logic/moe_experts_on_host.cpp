// The CUDA MoE kernel's expert addressing and FP8 decoding (dinfer_kernels/detail/moe_experts.h,
// which moe.cu's GEMMs and the host kernel call) executed on the host: the weights each expert of
// the kernels' list reads (a local expert, or a virtual expert of the shared expert) gathered
// through the kernels' own offsets and scale indices, and the token of every entry. Built and loaded
// by tests/kernels/test_device_logic.py through ctypes.
#include <cstdint>

#include "dinfer_kernels/detail/moe_experts.h"

using namespace dinfer_kernels;
using namespace dinfer_kernels::moe_experts;

extern "C" void dinfer_fp8_e4m3_to_float(const uint8_t* q, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = fp8_e4m3_to_float(q[i]);
}

// Expert x of E_local local experts (w13 [El, 2I, H], w2 [El, H, I] e4m3 with their block scales) and
// a shared expert of S (shared_w13 [2S, H], shared_w2 [H, S]), as GEMM 1 and GEMM 2 read it:
// gate / up [width, H] and down [H, width] dequantised (fp32 products), width returned. The walk is
// the kernels': a weight row's element offset gate_at / up_at + n H (GEMM 1), down_at + h down_ld + n
// (GEMM 2), its scale at w13_scale_index / w2_scale_index.
extern "C" int64_t dinfer_moe_expert_on_host(int64_t x, int64_t El, int64_t H, int64_t I, int64_t S,
                                             const uint8_t* w13, const uint8_t* w2, const float* s13,
                                             const float* s2, const uint8_t* sw13, const uint8_t* sw2,
                                             const float* ss13, const float* ss2, float* gate, float* up,
                                             float* down) {
  const ExpertSlice s = expert_slice(x, El, H, I, S);
  const uint8_t* q13 = s.shared ? sw13 : w13;
  const uint8_t* q2 = s.shared ? sw2 : w2;
  const float* sc13 = s.shared ? ss13 : s13;
  const float* sc2 = s.shared ? ss2 : s2;
  for (int64_t n = 0; n < s.width; ++n)
    for (int64_t k = 0; k < H; ++k) {
      gate[n * H + k] = fp8_dequant(q13[s.gate_at + n * H + k], sc13[w13_scale_index(s, false, n, k, H)]);
      up[n * H + k] = fp8_dequant(q13[s.up_at + n * H + k], sc13[w13_scale_index(s, true, n, k, H)]);
    }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t n = 0; n < s.width; ++n)
      down[h * s.width + n] = fp8_dequant(q2[s.down_at + h * s.down_ld + n], sc2[w2_scale_index(s, h, n)]);
  return s.width;
}

// The number of virtual experts, and for every entry of the kernels' list its token (entry_token)
// and back (virtual_entry of a virtual expert's entry must give it again; -1 where it does not).
extern "C" int32_t dinfer_moe_entries_on_host(int64_t T, int64_t top_k, int64_t S, int64_t I,
                                              int64_t* token) {
  const int32_t nv = num_virtual(S, I);
  const int64_t n = num_entries(T, top_k, nv);
  for (int64_t e = 0; e < n; ++e) {
    token[e] = entry_token(e, T, top_k);
    if (e >= T * top_k && virtual_entry(token[e], (e - T * top_k) / T, T, top_k) != e) token[e] = -1;
  }
  return nv;
}
