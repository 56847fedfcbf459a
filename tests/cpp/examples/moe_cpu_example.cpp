// A C++ runtime calling the host MoE with raw pointers: no Python, no torch. Three fp32 tokens of
// width 4, two experts of width 3, top-1 with softmax routing: each token's output is its expert's
// softmax weight times W2 (silu(g) * u), [g; u] = W13 x, checked against a direct double computation.
#include <cmath>
#include <cstdio>

#include "dinfer_kernels/moe.h"

int main() {
  using namespace dinfer_kernels;
  const int T = 3, H = 4, E = 2, I = 3;
  float hidden[T][H], router[E][H], w13[E][2 * I][H], w2[E][H][I], out[T][H];
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) hidden[t][h] = std::sin(1.0f + t * H + h);
  for (int e = 0; e < E; ++e) {
    for (int h = 0; h < H; ++h) router[e][h] = (e == 0 ? 1.f : -1.f) * std::cos(0.5f * h);
    for (int j = 0; j < 2 * I; ++j)
      for (int h = 0; h < H; ++h) w13[e][j][h] = 0.3f * std::sin(0.7f * (e + 1) * (j + 1) + h);
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < I; ++j) w2[e][h][j] = 0.4f * std::cos(0.9f * (e + 2) * (h + 1) + j);
  }
  MoeParams p;
  p.hidden = hidden;
  p.dtype = ScalarType::kFloat32;
  p.num_tokens = T;
  p.hidden_size = H;
  p.router_weight = router;
  p.router_dtype = ScalarType::kFloat32;
  p.w13 = w13;
  p.w2 = w2;
  p.num_experts = E;
  p.inter_size = I;
  p.top_k = 1;
  p.local_experts = E;  // every expert is local: w13 / w2 hold all E
  p.expert_offset = 0;
  p.out = out;
  moe_cpu(p, 1);
  for (int t = 0; t < T; ++t) {
    double logit[E];
    for (int e = 0; e < E; ++e) {
      logit[e] = 0;
      for (int h = 0; h < H; ++h) logit[e] += double(hidden[t][h]) * router[e][h];
    }
    const int e = logit[1] > logit[0] ? 1 : 0;
    const double w = 1.0 / (1.0 + std::exp(logit[1 - e] - logit[e]));  // its softmax probability
    double a[I];
    for (int j = 0; j < I; ++j) {
      double g = 0, u = 0;
      for (int h = 0; h < H; ++h) {
        g += double(w13[e][j][h]) * hidden[t][h];
        u += double(w13[e][I + j][h]) * hidden[t][h];
      }
      a[j] = g / (1.0 + std::exp(-g)) * u;
    }
    for (int h = 0; h < H; ++h) {
      double y = 0;
      for (int j = 0; j < I; ++j) y += double(w2[e][h][j]) * a[j];
      if (std::fabs(out[t][h] - w * y) > 1e-5) {
        std::printf("token %d dim %d: %f, want %f\n", t, h, out[t][h], w * y);
        return 1;
      }
    }
  }
  std::printf("OK\n");
  return 0;
}
