// A C++ runtime calling the host attention with raw pointers: no Python, no torch.
// One sequence, a 4-row fp32 cache (2 dims, one head), a window of two rows at positions 1 and 3
// refreshed without write_back: the rows attend over the cache with the window's keys substituted,
// and the cache is left as it was.
#include <cmath>
#include <cstdio>

#include "dinfer_kernels/attention.h"

int main() {
  using namespace dinfer_kernels;
  float k_cache[4][2] = {{1, 0}, {0, 1}, {1, 1}, {0, 0}};
  float v_cache[4][2] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};
  const float q[2][2] = {{2, 0}, {0, 1}};
  const float k[2][2] = {{-1, 0}, {0, 2}};  // fresh keys of positions 1 and 3
  const float v[2][2] = {{10, 0}, {0, 10}};
  const int64_t positions[2] = {1, 3};
  const int32_t seq_lens[1] = {4};
  float out[2][2], lse[2];
  AttentionParams p;
  p.batch = 1;
  p.window = 2;
  p.heads_q = p.heads_kv = 1;
  p.head_dim = 2;
  p.cache_len = 4;
  p.dtype = ScalarType::kFloat32;
  p.q = q;
  p.k = k;
  p.v = v;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.q_stride[0] = p.k_stride[0] = p.v_stride[0] = p.out_stride[0] = 4;  // [B, W, H, D]
  p.q_stride[1] = p.k_stride[1] = p.v_stride[1] = p.out_stride[1] = 2;
  p.q_stride[2] = p.k_stride[2] = p.v_stride[2] = p.out_stride[2] = 2;
  p.k_cache_stride[0] = p.v_cache_stride[0] = 8;  // [B, S, Hkv, D]
  p.k_cache_stride[1] = p.v_cache_stride[1] = 2;
  p.k_cache_stride[2] = p.v_cache_stride[2] = 2;
  p.positions = positions;
  p.seq_lens = seq_lens;
  p.write_back = false;
  p.q_block = 2;
  p.kv_block = 4;
  p.scale = 1.0f;
  p.out = out;
  p.lse = lse;
  attention_cpu(p, 1);
  // The keys each row sees: cache rows 0 and 2, fresh rows at 1 and 3.
  const float keys[4][2] = {{1, 0}, {-1, 0}, {1, 1}, {0, 2}};
  const float vals[4][2] = {{1, 2}, {10, 0}, {5, 6}, {0, 10}};
  for (int w = 0; w < 2; ++w) {
    double z = 0, o[2] = {0, 0};
    for (int s = 0; s < 4; ++s) {
      const double e = std::exp(q[w][0] * keys[s][0] + q[w][1] * keys[s][1]);
      z += e;
      o[0] += e * vals[s][0];
      o[1] += e * vals[s][1];
    }
    for (int d = 0; d < 2; ++d)
      if (std::fabs(out[w][d] - o[d] / z) > 1e-5) {
        std::printf("row %d dim %d: %f, want %f\n", w, d, out[w][d], o[d] / z);
        return 1;
      }
    if (std::fabs(lse[w] - std::log(z)) > 1e-5) return 1;
  }
  if (k_cache[1][0] != 0 || k_cache[3][1] != 0 || v_cache[3][0] != 7) return 1;  // untouched
  std::printf("OK\n");
  return 0;
}
