// A C++ runtime calling the host rope with raw pointers and its own cos / sin table: no Python, no
// torch. One sequence, two tokens at positions 0 and 3, one head of 6 dims of which 4 rotate: each
// pair (x[j], x[j + 2]) turns by the angle p * inv_freq[j], and the last two dims pass through.
#include <cmath>
#include <cstdio>

#include "dinfer_kernels/rope.h"

int main() {
  using namespace dinfer_kernels;
  const int rd = 4, table_len = 8;
  const double theta = 100.0;
  float table[table_len][rd];
  for (int p = 0; p < table_len; ++p)
    for (int j = 0; j < rd / 2; ++j) {
      const double a = p / std::pow(theta, 2.0 * j / rd);
      table[p][j] = static_cast<float>(std::cos(a));
      table[p][rd / 2 + j] = static_cast<float>(std::sin(a));
    }
  const float x[2][6] = {{1, 2, 3, 4, 5, 6}, {1, 0, 0, 1, -7, 8}};
  const int64_t positions[2] = {0, 3};
  float out[2][6];
  RopeParams p;
  p.batch = 1;
  p.tokens = 2;
  p.heads = 1;
  p.head_dim = 6;
  p.rotary_dim = rd;
  p.dtype = ScalarType::kFloat32;
  p.x = x;
  p.x_stride[0] = 12;  // [B, T, H, D]
  p.x_stride[1] = 6;
  p.x_stride[2] = 6;
  p.positions = positions;
  p.cos_sin = &table[0][0];
  p.table_len = table_len;
  p.out = out;
  p.out_stride[0] = 12;
  p.out_stride[1] = 6;
  p.out_stride[2] = 6;
  rope_cpu(p, 1);
  for (int t = 0; t < 2; ++t) {
    for (int j = 0; j < rd / 2; ++j) {
      const double a = positions[t] / std::pow(theta, 2.0 * j / rd);
      const double x1 = x[t][j], x2 = x[t][j + rd / 2];
      if (std::fabs(out[t][j] - (x1 * std::cos(a) - x2 * std::sin(a))) > 1e-5 ||
          std::fabs(out[t][j + rd / 2] - (x2 * std::cos(a) + x1 * std::sin(a))) > 1e-5) {
        std::printf("token %d pair %d is not rotated by %f\n", t, j, a);
        return 1;
      }
    }
    if (out[t][4] != x[t][4] || out[t][5] != x[t][5]) return 1;  // past rotary_dim: copied
  }
  std::printf("OK\n");
  return 0;
}
