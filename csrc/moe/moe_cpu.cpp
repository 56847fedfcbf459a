// Host MoE layer: the MoeParams contract over host arrays (router, top-k, the two expert GEMMs and the
// weighted combine in one call, where the torch reference runs ~10 ops per call plus ~6 per expert).
//
// 1. Route, one token at a time: fp32 logits (dot products, or the given ones), softmax / sigmoid,
//    bias, groups and top-k with the reference's tie rule (moe_math), the weights (or take the given
//    top-k); the slots are then sorted by expert id so that the combine adds them in the reference's
//    order.
// 2. Bucket the (token, slot) entries of the local experts by expert (counting sort, token order);
//    the entries of other experts are dropped here and cost nothing after.
// 3. Gather each expert's rows (fp32, or bf16 as they are on the AVX512-BF16 path), then two rounds
//    of tasks, each a chunk of kCols weight rows of one expert run over all of the expert's rows, so
//    every weight chunk is brought into its vector layout once per call: (a) the gate and up rows of
//    kCols intermediate outputs, finishing a = round(silu(g) u) to the dtype; (b) kCols rows of W2,
//    finishing each entry's w * y into its slot row. Experts with fewer than kMinGemmRows rows take
//    dot products along K instead (the layout change would cost more than their products).
//    A shared expert is one more segment, of every token with weight 1 (its own intermediate size S).
//    FP8 weights: each task first dequantises its kCols weight rows (1-byte loads, the contract's
//    fp32(q) * scale rounded to the activation dtype) into scratch, then runs the same path on them, so
//    an FP8 call is bit-identical to the call on the dequantised weights.
// 4. Combine, one token at a time: the token's slots summed in fp32, in expert order, then the shared
//    expert's, rounded once.
// Every output element is computed by one thread in a fixed order: the result does not depend on the
// thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include <omp.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "dinfer_kernels/detail/host_math.h"
#include "dinfer_kernels/detail/host_rows.h"
#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/moe_experts.h"
#include "dinfer_kernels/detail/moe_math.h"
#include "dinfer_kernels/moe.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"  // 16-float vectors by value, internal only (see attention_cpu)
#endif

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace {

using vcols = host::vreg;  // one register of outputs
constexpr int kCols = host::kRegLanes;  // weight rows per transposed chunk: one vector of outputs
// Rows of x per register block (independent FMA chains): the gate/up block holds 2 kRows
// accumulators plus two weight vectors and a broadcast, within the 32 AVX-512 or 16 AVX/SSE registers.
#if defined(__AVX512F__)
constexpr int kRows = 8;
#else
constexpr int kRows = 6;
#endif
constexpr int64_t kMinGemmRows = 8;  // below this, dot products (no transposition)
constexpr int64_t kChunkTokens = 1024;  // tokens per pass: bounds the slot buffer
constexpr int64_t kMacsPerThread = 1 << 20;  // multiply-adds below which another thread does not pay

// moe_math::silu_mul (the device kernels' SiLU) lane-wise, with the vector exp of host_math (libm's expf is not): exp(-|g|) <= 1.
inline vcols silu_mul(vcols g, vcols u) {
  const auto pos = g >= 0.f;
  const vcols e = host::exp_nonpositive(pos ? -g : g);
  return (pos ? g : g * e) / (1.f + e) * u;
}

float round_to(float x, ScalarType t) {
  switch (t) {
    case ScalarType::kBFloat16:
      return scalar::bf16_to_float(scalar::float_to_bf16(x));
    case ScalarType::kFloat16:
      return scalar::fp16_to_float(scalar::float_to_fp16(x));
    default:
      return x;
  }
}

// ---- GEMM pieces -------------------------------------------------------------------------------------
// Every product is rows x W^T with W [N, K] row-major (the layout of w13, w2 and the router). A task
// takes a chunk of kCols rows of W, brings it into a layout where one vector holds the chunk's
// kCols outputs (fp32 transposed [K][kCols], or bf16 pairs [K / 2][kCols] for the AVX512-BF16 dot
// instruction), and runs every row of its expert through it, kRows rows at a time.

// acc[r][c] = sum_k X[r][k] * Wt[k][c] for the kRows rows of X (ld K).
void block_fp32(const float* X, int64_t K, const float* Wt, vcols (&acc)[kRows]) {
  for (int r = 0; r < kRows; ++r) acc[r] = vcols{};
  for (int64_t k = 0; k < K; ++k) {
    const vcols w = host::loadv<vcols>(Wt + k * kCols);
    for (int r = 0; r < kRows; ++r) acc[r] += X[r * K + k] * w;
  }
}

// Two chunks at once (the gate and up rows of the same outputs): each x value loaded once.
void block2_fp32(const float* X, int64_t K, const float* Wg, const float* Wu, vcols (&g)[kRows],
                 vcols (&u)[kRows]) {
  for (int r = 0; r < kRows; ++r) g[r] = u[r] = vcols{};
  for (int64_t k = 0; k < K; ++k) {
    const vcols wg = host::loadv<vcols>(Wg + k * kCols), wu = host::loadv<vcols>(Wu + k * kCols);
    for (int r = 0; r < kRows; ++r) {
      const float x = X[r * K + k];
      g[r] += x * wg;
      u[r] += x * wu;
    }
  }
}

// out0[i] = X[i] . W[at0, at0 + K) and out1[i] = X[i] . W[at1, at1 + K) for the N rows of X (ld K):
// each weight vector is loaded (and a 16-bit one converted) once for the N rows, and each x vector
// once for both weight rows, 2 N register-wide FMA chains. Two weight rows per pass halve the traffic
// of X (fp32, N x K: with bf16 weights it was 8x the weight stream at LLaDA-MoE's ~4 rows per expert)
// and keep the FMA latency off the critical path.
template <ScalarType T, int N>
void dots2(const float* X, const void* W, int64_t at0, int64_t at1, int64_t K, float* out0, float* out1) {
  vcols a0[N] = {}, a1[N] = {};
  int64_t k = 0;
  for (; k + kCols <= K; k += kCols) {
    const vcols w0 = host::load_vreg<T>(W, at0 + k), w1 = host::load_vreg<T>(W, at1 + k);
    for (int i = 0; i < N; ++i) {
      const vcols x = host::loadv<vcols>(X + i * K + k);
      a0[i] += x * w0;
      a1[i] += x * w1;
    }
  }
  for (int i = 0; i < N; ++i) {
    out0[i] = host::hsum(a0[i]);
    out1[i] = host::hsum(a1[i]);
  }
  for (; k < K; ++k) {
    float w0, w1;
    host::load_row(W, at0 + k, 1, T, &w0);
    host::load_row(W, at1 + k, 1, T, &w1);
    for (int i = 0; i < N; ++i) {
      out0[i] += X[i * K + k] * w0;
      out1[i] += X[i * K + k] * w1;
    }
  }
}

template <ScalarType T, int... Ns>
void dots2_n(const float* X, int64_t n, const void* W, int64_t at0, int64_t at1, int64_t K, float* out0,
             float* out1, std::integer_sequence<int, Ns...>) {
  ((n == Ns + 1 ? dots2<T, Ns + 1>(X, W, at0, at1, K, out0, out1) : void()), ...);
}

// The same for n in [1, kMinGemmRows) rows and any weight dtype.
void dots2(const float* X, int64_t n, const void* W, ScalarType wt, int64_t at0, int64_t at1, int64_t K,
           float* out0, float* out1) {
  const auto ns = std::make_integer_sequence<int, kMinGemmRows - 1>{};
  switch (wt) {
    case ScalarType::kFloat32:
      return dots2_n<ScalarType::kFloat32>(X, n, W, at0, at1, K, out0, out1, ns);
    case ScalarType::kBFloat16:
      return dots2_n<ScalarType::kBFloat16>(X, n, W, at0, at1, K, out0, out1, ns);
    default:
      return dots2_n<ScalarType::kFloat16>(X, n, W, at0, at1, K, out0, out1, ns);
  }
}

// Row n of W in fp32: in place for fp32 weights, else converted into `row`.
inline const float* weight_row(const void* W, ScalarType wt, int64_t n, int64_t K, float* row) {
  if (wt == ScalarType::kFloat32) return static_cast<const float*>(W) + n * K;
  host::load_row(W, n * K, K, wt, row);
  return row;
}

#if defined(__AVX512F__)
// GCC 12's unpack intrinsics pass an _mm512_undefined_ps() merge source that -Wuninitialized flags.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// out[j * 16 + i] = word j of row i, for 16 rows of 16 32-bit words at base + i * stride_bytes: four
// rounds of in-register shuffles instead of 256 scalar moves.
void transpose16(const char* base, int64_t stride_bytes, void* out) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(base + i * stride_bytes);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  float* o = static_cast<float*>(out);
  for (int i = 0; i < 4; ++i) {
    _mm512_storeu_ps(o + i * 16, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_ps(o + (i + 8) * 16, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD));
    _mm512_storeu_ps(o + (i + 4) * 16, _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88));
    _mm512_storeu_ps(o + (i + 12) * 16, _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD));
  }
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#elif defined(__AVX2__) && defined(__F16C__)
// Eight fp32 values of W from element `at`, whatever the weight dtype (exact conversions).
inline __m256 load8(const void* W, ScalarType wt, int64_t at) {
  if (wt == ScalarType::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(W) + at);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(W) + at));
  if (wt == ScalarType::kBFloat16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

// out[j * 8 + i] = W[at + i * ld + j] in fp32, for 8 rows of 8 elements: three rounds of in-register
// shuffles instead of 64 scalar moves (and the conversion of 16-bit weights on the way).
void transpose8(const void* W, ScalarType wt, int64_t at, int64_t ld, float* out) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(W, wt, at + i * ld);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // r[i + c]: columns c and c + 4 of rows i .. i + 3
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(out + c * 8, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(out + (c + 4) * 8, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}
#elif defined(__SSE2__) && !defined(__AVX__)
// out[j * 4 + i] = W[at + i * ld + j] in fp32, for 4 rows of 4 elements: _MM_TRANSPOSE4_PS's unpacks
// and moves instead of 16 scalar moves (and the conversion of 16-bit weights on the way).
void transpose4(const void* W, ScalarType wt, int64_t at, int64_t ld, float* out) {
  __m128 r[4];
  for (int i = 0; i < 4; ++i) {
    switch (wt) {
      case ScalarType::kFloat32:
        r[i] = (__m128)host::load_vreg<ScalarType::kFloat32>(W, at + i * ld);
        break;
      case ScalarType::kBFloat16:
        r[i] = (__m128)host::load_vreg<ScalarType::kBFloat16>(W, at + i * ld);
        break;
      default:
        r[i] = (__m128)host::load_vreg<ScalarType::kFloat16>(W, at + i * ld);
        break;
    }
  }
  _MM_TRANSPOSE4_PS(r[0], r[1], r[2], r[3]);
  for (int j = 0; j < 4; ++j) _mm_storeu_ps(out + j * 4, r[j]);
}
#endif

// Wt[k * kCols + c] = W[n0 + c][k] in fp32, zero for c >= nc.
void transpose_chunk(const void* W, ScalarType wt, int64_t n0, int nc, int64_t K, float* row, float* Wt) {
  int64_t k0 = 0;
#if defined(__AVX512F__)
  if (wt == ScalarType::kFloat32 && nc == kCols) {  // whole 16 x 16 blocks
    const char* base = static_cast<const char*>(W) + n0 * K * sizeof(float);
    for (; k0 + 16 <= K; k0 += 16)
      transpose16(base + k0 * sizeof(float), K * static_cast<int64_t>(sizeof(float)), Wt + k0 * kCols);
    if (k0 == K) return;
  }
#elif defined(__AVX2__) && defined(__F16C__)
  if (nc == kCols) {  // whole 8 x 8 blocks
    for (; k0 + 8 <= K; k0 += 8) transpose8(W, wt, n0 * K + k0, K, Wt + k0 * kCols);
    if (k0 == K) return;
  }
#elif defined(__SSE2__) && !defined(__AVX__)
  static_assert(kCols == 4, "the SSE2 chunks are one 4-float register wide");
  if (nc == kCols) {  // whole 4 x 4 blocks
    for (; k0 + 4 <= K; k0 += 4) transpose4(W, wt, n0 * K + k0, K, Wt + k0 * kCols);
    if (k0 == K) return;
  }
#endif
  if (nc < kCols) std::fill(Wt + k0 * kCols, Wt + K * kCols, 0.f);
  for (int c = 0; c < nc; ++c) {
    const float* w = weight_row(W, wt, n0 + c, K, row);
    for (int64_t k = k0; k < K; ++k) Wt[k * kCols + c] = w[k];
  }
}

inline int64_t even(int64_t k) { return (k + 1) / 2 * 2; }

#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;

// Wp[kp * kCols + c] = W[n0 + c][2 kp] | W[n0 + c][2 kp + 1] << 16 (zeros past nc and past K).
void pack_pairs(const uint16_t* W, int64_t n0, int nc, int64_t K, uint32_t* Wp) {
  const int64_t half = even(K) / 2;
  int64_t kp0 = 0;
  if (nc == kCols) {  // whole 16 x 16 blocks of pairs: a transpose of 32-bit words
    const char* base = reinterpret_cast<const char*>(W + n0 * K);
    for (; kp0 + 16 <= K / 2; kp0 += 16)
      transpose16(base + kp0 * 4, K * static_cast<int64_t>(sizeof(uint16_t)), Wp + kp0 * kCols);
  }
  if (nc < kCols || K % 2) std::fill(Wp + kp0 * kCols, Wp + half * kCols, 0u);
  for (int c = 0; c < nc; ++c) {
    const uint16_t* w = W + (n0 + c) * K;
    for (int64_t kp = kp0; kp < K / 2; ++kp) {
      uint32_t pair;
      std::memcpy(&pair, w + 2 * kp, sizeof pair);
      Wp[kp * kCols + c] = pair;
    }
    if (K % 2) Wp[(K / 2) * kCols + c] = w[K - 1];
  }
}

inline __m512 dp(__m512 acc, const uint16_t* x_pair, const __m512i& w) {
  int32_t pair;
  std::memcpy(&pair, x_pair, sizeof pair);
  return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
}

// The bf16 versions of block_fp32 / block2_fp32: X bf16 rows of even(K) (zero-padded), fp32 sums.
void block_pairs(const uint16_t* X, int64_t K, const uint32_t* Wp, __m512 (&acc)[kRows]) {
  const int64_t half = even(K) / 2;
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < half; ++kp) {
    const __m512i w = _mm512_loadu_si512(Wp + kp * kCols);
    for (int r = 0; r < kRows; ++r) acc[r] = dp(acc[r], X + r * 2 * half + 2 * kp, w);
  }
}

void block2_pairs(const uint16_t* X, int64_t K, const uint32_t* Wg, const uint32_t* Wu, __m512 (&g)[kRows],
                  __m512 (&u)[kRows]) {
  const int64_t half = even(K) / 2;
  for (int r = 0; r < kRows; ++r) g[r] = u[r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < half; ++kp) {
    const __m512i wg = _mm512_loadu_si512(Wg + kp * kCols), wu = _mm512_loadu_si512(Wu + kp * kCols);
    for (int r = 0; r < kRows; ++r) {
      const uint16_t* x = X + r * 2 * half + 2 * kp;
      g[r] = dp(g[r], x, wg);
      u[r] = dp(u[r], x, wu);
    }
  }
}
#else
constexpr bool kBf16Pairs = false;
#endif

// ---- routing ------------------------------------------------------------------------------------

// logit[e] = x . W[e] over K, accumulated in fp64 and rounded once: the choice of experts and their
// weights are sensitive to the logits' last bits, so they should be as close as possible to any
// accurate fp32 GEMM's (an fp32 dot product in lanes is off by a few ulps). Cheap: E dot products.
void router_logits(const float* x, int64_t K, const void* W, ScalarType wt, int64_t E, float* logit,
                   float* row) {
  constexpr int kDLanes = 8;
  for (int64_t e = 0; e < E; ++e) {
    const float* w = row;
    if (wt == ScalarType::kFloat32) {
      w = static_cast<const float*>(W) + e * K;
    } else {
      host::load_row(W, e * K, K, wt, row);
    }
    double lane[kDLanes] = {};
    int64_t k = 0;
    for (; k + kDLanes <= K; k += kDLanes)
      for (int j = 0; j < kDLanes; ++j) lane[j] += static_cast<double>(x[k + j]) * w[k + j];
    double sum = 0.0;
    for (int j = 0; j < kDLanes; ++j) sum += lane[j];
    for (; k < K; ++k) sum += static_cast<double>(x[k]) * w[k];
    logit[e] = static_cast<float>(sum);
  }
}

// Insertion sort of a token's slots by expert id (stable): the combine's order, the reference's.
void sort_slots(int32_t* id, float* wt, int k) {
  for (int j = 1; j < k; ++j)
    for (int i = j; i > 0 && id[i] < id[i - 1]; --i) {
      std::swap(id[i], id[i - 1]);
      std::swap(wt[i], wt[i - 1]);
    }
}

struct Route {
  std::vector<float> logits, sel, wsrc, gscore;
  std::vector<char> excluded, kept;
  std::vector<float> x;  // the token's hidden row in fp32
};

// Experts and weights of token t into id[0, k), wt[0, k), sorted by expert id (-1: none left).
void route_token(const MoeParams& p, int64_t t, Route& s, int32_t* id, float* wt) {
  const int64_t E = p.num_experts, H = p.hidden_size;
  const int k = p.top_k;
  float* logit = s.logits.data();
  if (p.router_logits != nullptr) {
    std::memcpy(logit, p.router_logits + t * E, static_cast<size_t>(E) * sizeof(float));
  } else {
    host::load_row(p.hidden, t * H, H, p.dtype, s.x.data());
    router_logits(s.x.data(), H, p.router_weight, p.router_dtype, E, logit, s.sel.data());
  }
  float* sel = s.sel.data();
  float* wsrc = s.wsrc.data();
  if (p.scoring == MoeScoring::kSoftmax) {
    float m = -INFINITY;
    for (int64_t e = 0; e < E; ++e) m = (logit[e] > m || logit[e] != logit[e]) ? logit[e] : m;
    if (m == -INFINITY) m = 0.f;  // every logit -inf: keep exp() finite (the output is NaN anyway)
    for (int64_t e = 0; e < E; ++e) sel[e] = moe_math::router_exp(logit[e], m);
    // As torch does: a lane-wise sum (a running one loses ~sqrt(E) ulps over hundreds of experts),
    // then a multiply by its reciprocal.
    const float inv_z = 1.f / host::lane_sum(sel, E);
    for (int64_t e = 0; e < E; ++e) {
      sel[e] = sel[e] * inv_z + (p.expert_bias ? p.expert_bias[e] : 0.f);
      wsrc[e] = sel[e];  // softmax: the bias stays in the weights
    }
  } else {
    for (int64_t e = 0; e < E; ++e) {
      wsrc[e] = moe_math::sigmoid(logit[e]);  // sigmoid: the weights are the unbiased scores
      sel[e] = wsrc[e] + (p.expert_bias ? p.expert_bias[e] : 0.f);
    }
  }
  for (int64_t e = 0; e < E; ++e) sel[e] = moe_math::rankable(sel[e]);
  char* excluded = s.excluded.data();
  std::fill(excluded, excluded + E, 0);
  if (p.num_groups > 1) {  // keep the topk_groups groups with the best sum of their two best scores
    const int64_t G = p.num_groups, gs = E / G;
    for (int64_t g = 0; g < G; ++g) s.gscore[g] = moe_math::group_score(sel + g * gs, gs);
    std::fill(s.kept.begin(), s.kept.end(), 0);
    for (int r = 0; r < p.topk_groups; ++r) {
      float bv = -INFINITY;
      int32_t bi = INT32_MAX;
      for (int64_t g = 0; g < G; ++g)
        if (!s.kept[g] && moe_math::beats(s.gscore[g], static_cast<int32_t>(g), bv, bi)) {
          bv = s.gscore[g];
          bi = static_cast<int32_t>(g);
        }
      if (bi != INT32_MAX) s.kept[bi] = 1;
    }
    for (int64_t e = 0; e < E; ++e) excluded[e] = !s.kept[e / gs];
  }
  float total = 0.f;
  for (int j = 0; j < k; ++j) {  // k rounds of an argmax (ties: lower expert), in slot order
    float bv = -INFINITY;
    int32_t bi = INT32_MAX;
    for (int64_t e = 0; e < E; ++e)
      if (!excluded[e] && moe_math::beats(sel[e], static_cast<int32_t>(e), bv, bi)) {
        bv = sel[e];
        bi = static_cast<int32_t>(e);
      }
    id[j] = bi != INT32_MAX ? bi : -1;
    wt[j] = bi != INT32_MAX ? wsrc[bi] : 0.f;
    if (bi != INT32_MAX) excluded[bi] = 1;
    total += wt[j];
  }
  for (int j = 0; j < k; ++j) {
    if (p.renormalize) wt[j] = wt[j] / (total + 1e-20f);
    wt[j] = wt[j] * p.routed_scaling;
  }
  sort_slots(id, wt, k);
}

// The given top-k of token t (the all-to-all path), sorted by expert id as route_token's.
void given_token(const MoeParams& p, int64_t t, int32_t* id, float* wt) {
  const int k = p.top_k;
  std::memcpy(id, p.topk_ids + t * k, static_cast<size_t>(k) * sizeof(int32_t));
  std::memcpy(wt, p.topk_weights + t * k, static_cast<size_t>(k) * sizeof(float));
  sort_slots(id, wt, k);
}

// ---- experts ------------------------------------------------------------------------------------

// The entries of one expert: list[first, first + n), rows [row0, row0 + n) of the row buffers
// (padded to a multiple of kRows when the chunk GEMMs run, so a block never reads another expert's).
// A local expert's entries are its (token, slot) pairs; the shared expert's, every token of the chunk.
struct Segment {
  moe_experts::ExpertSlice w;  // its weights (all of its intermediate columns: w.width of them)
  int64_t first, n, row0;
  int64_t a_at;  // its rows of a: from R.a[a_at] (w.width fp32 each), or R.ah[a_at] (even(w.width) bf16)
  bool gemm;  // n >= kMinGemmRows: chunk GEMMs; else dot products
  bool pairs;  // bf16 through the AVX512-BF16 dot instruction (x and a kept in bf16)
};

// The chunk's rows grouped by expert: x (the gathered hidden rows) and a = silu(g) u.
struct Rows {
  int64_t H, Hp;
  std::vector<float> x, a;  // [rows, H] fp32, the a rows of each segment (segments off the pair path)
  std::vector<uint16_t> xh, ah;  // [rows, even(H)] bf16, the a rows of each segment (pair-path segments)
};

struct Scratch {
  std::vector<float> wg, wu, row;  // transposed chunks, a converted weight row
  std::vector<uint32_t> pg, pu;  // bf16 pair chunks
  std::vector<float> deq;  // FP8 rows dequantised into the activation dtype (2 kCols rows)
};

inline bool fp8_weights(const MoeParams& p) { return p.weight_dtype == ScalarType::kFloat8E4M3; }

// kCols FP8 weights as fp32 (exact): bits 0-6 into an fp32's exponent (bias moved by 120) and mantissa
// for normal values, m * 2^-9 for subnormal ones (no fp32 subnormal on the way), S.1111.111 NaN.
inline vcols fp8_to_vcols(const uint8_t* q) {
  typedef uint8_t vcols_u8 __attribute__((vector_size(kCols)));
  vcols_u8 b;
  std::memcpy(&b, q, sizeof b);
  const host::vreg_u32 u = __builtin_convertvector(b, host::vreg_u32), mag = u & 0x7Fu;
  const vcols normal = (vcols)((mag << 20) + (120u << 23));
  const vcols sub = __builtin_convertvector(mag, vcols) * 0x1p-9f;
  vcols v = mag < 8u ? sub : normal;
  v = mag == 0x7Fu ? vcols{} + NAN : v;
  return (vcols)((host::vreg_u32)v | ((u & 0x80u) << 24));
}

// Rows [0, nc) of an FP8 weight (row c: K bytes from q + c * ld; the fp32 scales of its 128-column
// blocks from scale_row(c)) dequantised as the contract says, fp32(q) * scale rounded once to dt, into
// dst (rows of K in dt). tmp: K floats.
template <class ScaleRow>
void dequant_rows(const uint8_t* q, int64_t ld, int nc, int64_t K, ScaleRow scale_row, ScalarType dt,
                  void* dst, float* tmp) {
  static_assert(kMoeFp8Block % kCols == 0, "a vector of weights lies in one scale block");
  for (int c = 0; c < nc; ++c) {
    const uint8_t* qr = q + c * ld;
    const float* sr = scale_row(c);
    int64_t k = 0;
    for (; k + kCols <= K; k += kCols) host::storev(tmp + k, fp8_to_vcols(qr + k) * sr[k / kMoeFp8Block]);
    for (; k < K; ++k) tmp[k] = moe_experts::fp8_dequant(qr[k], sr[k / kMoeFp8Block]);
    host::store_row(tmp, K, dt, dst, c * K);
  }
}

// The kCols outputs [n0, n0 + nc) of segment s: its gate rows and its up rows.
void gate_up_rows(const MoeParams& p, const Segment& s, int64_t n0, int nc, Scratch& sc, const void*& wg,
                  const void*& wu) {
  const int64_t H = p.hidden_size;
  const size_t elem = host::elem_bytes(p.dtype);
  if (!fp8_weights(p)) {
    const char* w13 = static_cast<const char*>(s.w.shared ? p.shared_w13 : p.w13);
    wg = w13 + (s.w.gate_at + n0 * H) * elem;
    wu = w13 + (s.w.up_at + n0 * H) * elem;
    return;
  }
  const uint8_t* q = static_cast<const uint8_t*>(s.w.shared ? p.shared_w13 : p.w13);
  const float* scale = s.w.shared ? p.shared_w13_scale : p.w13_scale;
  char* d = reinterpret_cast<char*>(sc.deq.data());
  for (const bool up : {false, true}) {
    dequant_rows(
        q + (up ? s.w.up_at : s.w.gate_at) + n0 * H, H, nc, H,
        [&](int c) { return scale + moe_experts::w13_scale_index(s.w, up, n0 + c, 0, H); }, p.dtype,
        d + (up ? kCols * H * elem : 0), sc.row.data());
  }
  wg = d;
  wu = d + kCols * H * elem;
}

// Rows [n0, n0 + nc) of segment s's W2 (rows of w.width).
const void* down_rows(const MoeParams& p, const Segment& s, int64_t n0, int nc, Scratch& sc) {
  const int64_t I = s.w.width;
  if (!fp8_weights(p))
    return static_cast<const char*>(s.w.shared ? p.shared_w2 : p.w2) +
           (s.w.down_at + n0 * s.w.down_ld) * host::elem_bytes(p.dtype);
  const uint8_t* q = static_cast<const uint8_t*>(s.w.shared ? p.shared_w2 : p.w2);
  const float* scale = s.w.shared ? p.shared_w2_scale : p.w2_scale;
  dequant_rows(
      q + s.w.down_at + n0 * s.w.down_ld, s.w.down_ld, nc, I,
      [&](int c) { return scale + moe_experts::w2_scale_index(s.w, n0 + c, 0); }, p.dtype, sc.deq.data(),
      sc.row.data());
  return sc.deq.data();
}

// The kRows x kCols block of products as plain floats (__m512 is this same vector type).
inline void spill(const vcols (&acc)[kRows], float (&out)[kRows][kCols]) {
  for (int r = 0; r < kRows; ++r) host::storev(out[r], acc[r]);
}

// a[:, n0 + c] = round(silu(g) u) of segment s for the outputs [n0, n0 + nc) of the intermediate dim.
void gate_up_task(const MoeParams& p, const Segment& s, int64_t n0, int nc, Rows& R, Scratch& sc) {
  const int64_t H = R.H, I = s.w.width, Ip = even(I);
  const void *wg, *wu;  // rows n0.. of the gate and the up half, in the activation dtype
  gate_up_rows(p, s, n0, nc, sc, wg, wu);
  // a of one row's nc outputs, rounded to the dtype as the reference does before W2 (bf16 rows of the
  // pair path are rounded by their conversion).
  auto finish = [&](int64_t row, const float* g, const float* u) {
    float a[kCols];
    host::storev(a, silu_mul(host::loadv<vcols>(g), host::loadv<vcols>(u)));
    if (s.pairs) {
      host::store_row(a, nc, ScalarType::kBFloat16, R.ah.data(), s.a_at + (row - s.row0) * Ip + n0);
      return;
    }
    if (p.dtype != ScalarType::kFloat32)
      for (int c = 0; c < nc; ++c) a[c] = round_to(a[c], p.dtype);
    std::memcpy(R.a.data() + s.a_at + (row - s.row0) * I + n0, a, static_cast<size_t>(nc) * sizeof(float));
  };
  if (!s.gemm) {
    const int64_t up =
        (static_cast<const char*>(wu) - static_cast<const char*>(wg)) /
        static_cast<int64_t>(host::elem_bytes(p.dtype));  // elements from a gate row to its up row
    float G[kMinGemmRows][kCols] = {}, U[kMinGemmRows][kCols] = {};
    const float* X = R.x.data() + s.row0 * H;
    for (int c = 0; c < nc; ++c) {  // the gate and up rows of output c in one pass over X
      float g[kMinGemmRows] = {}, u[kMinGemmRows] = {};
      dots2(X, s.n, wg, p.dtype, c * H, up + c * H, H, g, u);
      for (int64_t i = 0; i < s.n; ++i) {
        G[i][c] = g[i];
        U[i][c] = u[i];
      }
    }
    for (int64_t i = 0; i < s.n; ++i) finish(s.row0 + i, G[i], U[i]);
    return;
  }
  float G[kRows][kCols], U[kRows][kCols];
#if defined(__AVX512BF16__)
  if (s.pairs) {
    pack_pairs(static_cast<const uint16_t*>(wg), 0, nc, H, sc.pg.data());
    pack_pairs(static_cast<const uint16_t*>(wu), 0, nc, H, sc.pu.data());
  }
#endif
  if (!s.pairs) {
    transpose_chunk(wg, p.dtype, 0, nc, H, sc.row.data(), sc.wg.data());
    transpose_chunk(wu, p.dtype, 0, nc, H, sc.row.data(), sc.wu.data());
  }
  for (int64_t r0 = 0; r0 < s.n; r0 += kRows) {
    const int64_t row = s.row0 + r0;
#if defined(__AVX512BF16__)
    if (s.pairs) {
      __m512 g[kRows], u[kRows];
      block2_pairs(R.xh.data() + row * R.Hp, H, sc.pg.data(), sc.pu.data(), g, u);
      spill(g, G);
      spill(u, U);
    }
#endif
    if (!s.pairs) {
      vcols g[kRows], u[kRows];
      block2_fp32(R.x.data() + row * H, H, sc.wg.data(), sc.wu.data(), g, u);
      spill(g, G);
      spill(u, U);
    }
    const int rows = static_cast<int>(std::min<int64_t>(kRows, s.n - r0));
    for (int r = 0; r < rows; ++r) finish(row + r, G[r], U[r]);
  }
}

// slots[entry][n0 + c] = w_entry * (W2 a)[n0 + c] for the entries of segment s.
void down_task(const MoeParams& p, const Segment& s, int64_t n0, int nc, const int32_t* list,
               const float* weights, Rows& R, Scratch& sc, float* slots) {
  const int64_t H = R.H, I = s.w.width;
  [[maybe_unused]] const int64_t Ip = even(I);  // the pair path's row length of a
  const void* w2 = down_rows(p, s, n0, nc, sc);  // rows n0.. of I, in the activation dtype
  auto finish = [&](int64_t i, const float* y) {  // entry i of the segment: w * y into its slot
    const int32_t entry = list[s.first + i];
    const float w = weights[entry];
    float* dst = slots + static_cast<int64_t>(entry) * H + n0;
    for (int c = 0; c < nc; ++c) dst[c] = w * y[c];
  };
  if (!s.gemm) {
    float Y[kMinGemmRows][kCols] = {};
    for (int c = 0; c < nc; c += 2) {  // outputs c and c + 1 in one pass (c alone, twice, at an odd end)
      const int c1 = std::min(c + 1, nc - 1);
      float y0[kMinGemmRows] = {}, y1[kMinGemmRows] = {};
      dots2(R.a.data() + s.a_at, s.n, w2, p.dtype, c * I, c1 * I, I, y0, y1);
      for (int64_t i = 0; i < s.n; ++i) {
        Y[i][c] = y0[i];
        Y[i][c1] = y1[i];
      }
    }
    for (int64_t i = 0; i < s.n; ++i) finish(i, Y[i]);
    return;
  }
  float Y[kRows][kCols];
#if defined(__AVX512BF16__)
  if (s.pairs) pack_pairs(static_cast<const uint16_t*>(w2), 0, nc, I, sc.pg.data());
#endif
  if (!s.pairs) transpose_chunk(w2, p.dtype, 0, nc, I, sc.row.data(), sc.wg.data());
  for (int64_t r0 = 0; r0 < s.n; r0 += kRows) {
#if defined(__AVX512BF16__)
    if (s.pairs) {
      __m512 y[kRows];
      block_pairs(R.ah.data() + s.a_at + r0 * Ip, I, sc.pg.data(), y);
      spill(y, Y);
    }
#endif
    if (!s.pairs) {
      vcols y[kRows];
      block_fp32(R.a.data() + s.a_at + r0 * I, I, sc.wg.data(), y);
      spill(y, Y);
    }
    const int rows = static_cast<int>(std::min<int64_t>(kRows, s.n - r0));
    for (int r = 0; r < rows; ++r) finish(r0 + r, Y[r]);
  }
}

int threads_for(int64_t macs, int64_t tasks, int max_threads) {
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>({max_threads, macs / kMacsPerThread, tasks})));
}

void moe_chunk(const MoeParams& p, int64_t t0, int64_t T, int max_threads) {
  const int64_t E = p.num_experts, El = p.local_experts, H = p.hidden_size, I = p.inter_size, k = p.top_k;
  const int64_t S = p.shared_inter_size;  // the shared expert: one more segment of every token
  const int64_t routed = T * k, entries = routed + (S > 0 ? T : 0);
  std::vector<int32_t> ids(routed);
  std::vector<float> w(entries, 1.f);  // the shared expert's entries keep weight 1
  if (p.topk_ids != nullptr) {
    for (int64_t t = 0; t < T; ++t) given_token(p, t0 + t, ids.data() + t * k, w.data() + t * k);
  } else {
    const int64_t route_macs = p.router_logits ? T * E : T * E * H;
    const int rt = threads_for(route_macs, T, max_threads);
#pragma omp parallel num_threads(rt)
    {
      Route s;
      s.logits.resize(E);
      s.sel.resize(std::max(E, H));
      s.wsrc.resize(E);
      s.gscore.resize(p.num_groups);
      s.kept.resize(p.num_groups);
      s.excluded.resize(E);
      s.x.resize(H);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) route_token(p, t0 + t, s, ids.data() + t * k, w.data() + t * k);
    }
  }

  // Entries (t * k + j) of each local expert, in token order; the local expert of entry i, or -1.
  auto local = [&](int64_t i) -> int64_t {
    const int64_t l = static_cast<int64_t>(ids[i]) - p.expert_offset;
    return l >= 0 && l < El ? l : -1;
  };
  std::vector<int64_t> start(El + 1, 0);
  for (int64_t i = 0; i < routed; ++i)
    if (local(i) >= 0) ++start[local(i) + 1];
  std::partial_sum(start.begin(), start.end(), start.begin());
  std::vector<int32_t> list(start[El] + entries - routed);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < routed; ++i)
      if (local(i) >= 0) list[fill[local(i)]++] = static_cast<int32_t>(i);
    for (int64_t i = routed; i < entries; ++i) list[start[El] + i - routed] = static_cast<int32_t>(i);
  }
  std::vector<Segment> segs;
  int64_t rows = 0, a_rows = 0, ah_rows = 0;
  auto add_segment = [&](const moe_experts::ExpertSlice& x, int64_t first, int64_t n) {
    const bool gemm = n >= kMinGemmRows, pairs = kBf16Pairs && gemm && p.dtype == ScalarType::kBFloat16;
    const int64_t padded = gemm ? (n + kRows - 1) / kRows * kRows : n;
    int64_t& at = pairs ? ah_rows : a_rows;
    segs.push_back({x, first, n, rows, at, gemm, pairs});
    at += padded * (pairs ? even(x.width) : x.width);
    rows += padded;
  };
  for (int32_t e = 0; e < El; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n > 0) add_segment(moe_experts::expert_slice(e, El, H, I, S), start[e], n);
  }
  if (S > 0) add_segment(moe_experts::slice_of(true, 0, S, S, H, 0, 0, 0, 0), start[El], T);
  Rows R{H, even(H), {}, {}, {}, {}};
  bool any_pairs = false, any_fp32 = false;
  for (const Segment& s : segs) (s.pairs ? any_pairs : any_fp32) = true;
  if (any_fp32) {  // zeros: the padding rows of a block
    R.x.assign(rows * H, 0.f);
    R.a.assign(a_rows, 0.f);
  }
  if (any_pairs) {
    R.xh.assign(rows * R.Hp, 0);
    R.ah.assign(ah_rows, 0);
  }
  struct Task {
    int32_t seg;
    int64_t n0;
  };
  std::vector<Task> up_tasks, down_tasks;
  for (int32_t i = 0; i < static_cast<int32_t>(segs.size()); ++i) {
    for (int64_t n0 = 0; n0 < segs[i].w.width; n0 += kCols) up_tasks.push_back({i, n0});
    for (int64_t n0 = 0; n0 < H; n0 += kCols) down_tasks.push_back({i, n0});
  }
  // Only the slots of local experts (and the shared expert's) are written, and only those are read.
  std::unique_ptr<float[]> slots(new float[entries * H]);
  const int64_t nseg = static_cast<int64_t>(segs.size());
  const int64_t nup = static_cast<int64_t>(up_tasks.size()), ndown = static_cast<int64_t>(down_tasks.size());
  const int64_t macs = (start[El] * I + (S > 0 ? T * S : 0)) * 3 * H;
  const int et = threads_for(macs, std::min(nup, ndown), max_threads);
#pragma omp parallel num_threads(et)
  {
    Scratch sc;
    const int64_t K = std::max({H, I, S});
    sc.row.resize(K);
    sc.wg.resize(K * kCols);
    sc.wu.resize(K * kCols);
    sc.pg.resize(even(K) / 2 * kCols);
    sc.pu.resize(even(K) / 2 * kCols);
    if (fp8_weights(p)) sc.deq.resize(2 * kCols * K);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < nseg; ++i) {  // gather each expert's rows
      const Segment& s = segs[i];
      for (int64_t r = 0; r < s.n; ++r) {
        const int64_t token = t0 + moe_experts::entry_token(list[s.first + r], T, k);
        if (s.pairs) {
          std::memcpy(R.xh.data() + (s.row0 + r) * R.Hp, static_cast<const uint16_t*>(p.hidden) + token * H,
                      static_cast<size_t>(H) * sizeof(uint16_t));
        } else {
          host::load_row(p.hidden, token * H, H, p.dtype, R.x.data() + (s.row0 + r) * H);
        }
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nup; ++i) {
      const Segment& s = segs[up_tasks[i].seg];
      const int64_t n0 = up_tasks[i].n0;
      gate_up_task(p, s, n0, static_cast<int>(std::min<int64_t>(kCols, s.w.width - n0)), R, sc);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ndown; ++i) {
      const int64_t n0 = down_tasks[i].n0;
      down_task(p, segs[down_tasks[i].seg], n0, static_cast<int>(std::min<int64_t>(kCols, H - n0)),
                list.data(), w.data(), R, sc, slots.get());
    }
  }

  const int ct = threads_for(entries * H / 8, T, max_threads);
#pragma omp parallel num_threads(ct)
  {
    std::vector<float> acc(H);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {  // slots in expert order: the reference's summation order
        if (local(t * k + j) < 0) continue;
        const float* src = slots.get() + (t * k + j) * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += src[h];
      }
      if (S > 0) {  // the shared expert after the routed sum, as the reference adds it
        const float* src = slots.get() + (routed + t) * H;
        for (int64_t h = 0; h < H; ++h) acc[h] += src[h];
      }
      host::store_row(acc.data(), H, p.dtype, p.out, (t0 + t) * H);
    }
  }
}
}  // namespace

void moe_cpu(const MoeParams& p, int num_threads) {
  if (p.num_tokens <= 0 || p.hidden_size <= 0) return;
  const int max_threads = num_threads > 0 ? num_threads : omp_get_max_threads();
  for (int64_t t0 = 0; t0 < p.num_tokens; t0 += kChunkTokens)
    moe_chunk(p, t0, std::min(kChunkTokens, p.num_tokens - t0), max_threads);
}

DINFER_ISA_END
}  // namespace dinfer_kernels
