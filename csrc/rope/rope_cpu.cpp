// Host rotary embedding: the RopeParams contract over host arrays.
//
// The angles are a table lookup (the caller's cos_sin rows), so a call costs loads and two products
// per element, nothing transcendental. Each head row goes through fp32 scratch: load, rotate, round
// once on the store; the dims past rotary_dim are copied as they are.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "dinfer_kernels/detail/host_rows.h"
#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/rope.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace {

// Elements per thread below which a second thread costs more (fork / join) than it saves.
constexpr int64_t kElementsPerThread = 16384;

void rotate_rows(const RopeParams& p, int64_t r0, int64_t r1) {
  const int64_t D = p.head_dim, half = p.rotary_dim / 2;
  const size_t eb = host::elem_bytes(p.dtype);
  std::vector<float> in(static_cast<size_t>(p.rotary_dim)), out(static_cast<size_t>(p.rotary_dim));
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / p.tokens, t = r % p.tokens;
    const float* c = p.cos_sin + p.positions[r] * p.rotary_dim;
    const float* s = c + half;
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t xi = b * p.x_stride[0] + t * p.x_stride[1] + h * p.x_stride[2];
      const int64_t oi = b * p.out_stride[0] + t * p.out_stride[1] + h * p.out_stride[2];
      host::load_row(p.x, xi, p.rotary_dim, p.dtype, in.data());
      const float* x1 = in.data();
      const float* x2 = x1 + half;
      for (int64_t j = 0; j < half; ++j) {
        out[j] = x1[j] * c[j] - x2[j] * s[j];
        out[half + j] = x2[j] * c[j] + x1[j] * s[j];
      }
      host::store_row(out.data(), p.rotary_dim, p.dtype, p.out, oi);
      if (D > p.rotary_dim && p.x != p.out)
        std::memmove(static_cast<char*>(p.out) + (oi + p.rotary_dim) * eb,
                     static_cast<const char*>(p.x) + (xi + p.rotary_dim) * eb, (D - p.rotary_dim) * eb);
    }
  }
}

}  // namespace

void rope_cpu(const RopeParams& p, int num_threads) {
  const int64_t rows = p.batch * p.tokens;
  if (rows <= 0 || p.heads <= 0 || p.head_dim <= 0) return;
  const int max_threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  const int64_t useful = std::max<int64_t>(1, rows * p.heads * p.head_dim / kElementsPerThread);
  const int threads = static_cast<int>(std::min<int64_t>({max_threads, useful, rows}));
  if (threads <= 1) {
    rotate_rows(p, 0, rows);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    rotate_rows(p, rows * t / n, rows * (t + 1) / n);
  }
}

DINFER_ISA_END
}  // namespace dinfer_kernels
