// CUDA backend of the fused decode step. Contract: dinfer_kernels/reference/decode.py.
//
// Two launches, no host synchronisation and no allocation (CUDA-graph capturable):
//   1. split_pass_kernel: one CTA per (row, vocabulary split). Streams its chunk of the logits once
//      with 16-byte loads and writes one decode_math::Partial (raw max/argmax/sum-exp, best score,
//      best non-mask score) to the workspace.
//   2. finalize_kernel: one CTA per sequence. Merges each row's partials in split order, then runs
//      the shared decode_math code (credit, fused logits, commit rules, progress guarantee), so
//      everything after the vocabulary pass is the code the CPU tests exercise.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "dinfer_kernels/decode.h"
#include "dinfer_kernels/decode_math.h"

namespace dinfer_kernels {
namespace {

using decode_math::kNoIndex;
using decode_math::Partial;

// `#pragma unroll` in __host__ __device__ code would trip the host compiler's -Wunknown-pragmas.
#if defined(__CUDA_ARCH__)
#define DINFER_UNROLL _Pragma("unroll")
#else
#define DINFER_UNROLL
#endif

constexpr int kSplitThreads = 256;
// 16-byte loads in flight per thread. At 48 registers 5 CTAs fit per SM, so ~80 KB are in flight per
// SM, well above what HBM latency x bandwidth needs (~30 KB).
constexpr int kUnroll = 4;
constexpr int kFinalizeThreads = 256;
constexpr int kStageRows = 1024;  // rows per sequence staged in shared memory (24 KB)
constexpr size_t kWorkspaceAlign = 256;
// Element indices are int32 (Partial stores them so); the margin keeps `v += blockDim` from wrapping.
constexpr int64_t kMaxVocab = int64_t{1} << 30;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- element formats -----------------------------------------------------------------------------

struct F32Tag {
  using Raw = float;
  static constexpr int kVec = 4;
};
struct BF16Tag {
  using Raw = uint16_t;
  static constexpr int kVec = 8;
};
struct F16Tag {
  using Raw = uint16_t;
  static constexpr int kVec = 8;
};

using scalar::bits_to_float;
using scalar::fast_exp2;
using scalar::fast_log2;

// Exact conversions (every bf16/fp16 value, subnormals included, is an fp32 value). Not sanitised.
DINFER_HD float to_float(float x, F32Tag) { return x; }
DINFER_HD float to_float(uint16_t x, BF16Tag) { return scalar::bf16_to_float(x); }
DINFER_HD float to_float(uint16_t x, F16Tag) { return scalar::fp16_to_float(x); }

DINFER_HD void unpack(const uint4& q, float (&z)[4], F32Tag) {
  z[0] = bits_to_float(q.x);
  z[1] = bits_to_float(q.y);
  z[2] = bits_to_float(q.z);
  z[3] = bits_to_float(q.w);
}

DINFER_HD void unpack(const uint4& q, float (&z)[8], BF16Tag) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  DINFER_UNROLL
  for (int k = 0; k < 4; ++k) {  // little endian: the lower half-word is the lower index
    z[2 * k] = bits_to_float(w[k] << 16);
    z[2 * k + 1] = bits_to_float(w[k] & 0xFFFF0000u);
  }
}

DINFER_HD void unpack(const uint4& q, float (&z)[8], F16Tag) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  DINFER_UNROLL
  for (int k = 0; k < 4; ++k) {
    z[2 * k] = to_float(static_cast<uint16_t>(w[k] & 0xFFFFu), F16Tag{});
    z[2 * k + 1] = to_float(static_cast<uint16_t>(w[k] >> 16), F16Tag{});
  }
}

// ---- hot-loop primitives -------------------------------------------------------------------------

// The logits are read exactly once: keep them out of L1 and let L2 fetch whole 256-byte sectors.
DINFER_HD uint4 load_stream(const uint4* p) {
#if defined(__CUDA_ARCH__)
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
#else
  return *p;
#endif
}

// exp(z - ms) for z <= ms (ms finite, or 0 while nothing finite was seen). The terms that dominate
// the sum have z close to ms, where z - ms is exact (Sterbenz) and the product is off by <= 0.5 ulp
// of a small argument: the sum stays within ~2 ulp of an expf-based one. MUFU.EX2 alone, because
// expf would cost ~8 instructions per element and the budget at full HBM rate is ~14 in total.
DINFER_HD float exp_shifted(float z, float ms) { return fast_exp2((z - ms) * kLog2e); }

// ---- per-thread scan -----------------------------------------------------------------------------

struct ScanCtx {
  int32_t mask_id;  // -1 when outside [0, V): no element is excluded
  float temperature;
  float inv_t;      // only for the prune bound; scores divide by temperature like the reference
  uint32_t key;     // decode_math::row_key of the row
};

// Upper bound of decode_math::gumbel(key, v) from the hash h = mix32(key ^ v) alone:
// g = -log(-log u) <= -log(1 - u) with u = (k + 0.5) / 2^23, k = h >> 9 (exact in fp32). With
// j = 2^23 - 1 - k, 1 - u = (j + 0.5) / 2^23 >= j / 2^23, so g <= 23 ln2 - ln j. Built from bits
// instead of I2F: 2^23 + j is exact in fp32, so subtracting 2^23 leaves jf = j exactly.
// jf == 0 gives +inf (never pruned).
DINFER_HD float gumbel_upper_bound(uint32_t h) {
  const float jf = bits_to_float((h >> 9) ^ 0x4B7FFFFFu) - 8388608.0f;
  return fmaf(fast_log2(jf), -kLn2, 23.0f * kLn2);
}

// A candidate whose computed bound is below this cannot beat `best`. The margin (2^-16 relative +
// 1e-3 absolute) dwarfs the errors of the bound (<= ~3 ulp of the score, lg2.approx ~1e-6, logf's
// ~1 ulp inside gumbel): pruning never changes a result, it only skips exact evaluations.
DINFER_HD float prune_threshold(float best) {
  if (best == INFINITY) return INFINITY;  // later indices cannot beat +inf (ties go to the lower)
  return best - (fabsf(best) * 0x1p-16f + 1e-3f);
}

// What one thread knows about its elements, visited in increasing index order (so a strict `>` is
// the lowest-index-wins rule). The sum is of exp(z - ms); ms == m once m is finite.
template <bool kSample>
struct ScanState {
  float m = -INFINITY, ms = 0.f, sum = 0.f;
  int32_t arg = kNoIndex;
  // Best score over v != mask_id (score = z at T == 0; then the all-token best is m/arg).
  float nmv = -INFINITY;
  int32_t nmi = kNoIndex;
  // kSample only: the mask token's score (scored apart so the loop needs no per-element test).
  float maskv = -INFINITY;
  int32_t maski = kNoIndex;
  float thr = -INFINITY;

  DINFER_HD void raise_max(float z, int32_t v) {  // z > m
    sum = decode_math::rescale(sum, m, z);
    m = ms = z;
    arg = v;
  }

  // Exact score update for sampling; beats() so that -inf scores still record the lowest index:
  // a live row then always has a candidate index, even if every score overflowed to -inf.
  DINFER_HD void offer_score(float z, int32_t v, const ScanCtx& c) {
    const float s = decode_math::score_of(z, c.temperature, c.key, v);
    if (decode_math::beats(s, v, nmv, nmi)) {
      nmv = s;
      nmi = v;
      thr = prune_threshold(s);
    }
  }

  // Any element, any value: the slow path (row head/tail, vectors holding +inf or the mask token).
  DINFER_HD void scalar(float raw, int32_t v, const ScanCtx& c) {
    const float z = decode_math::sanitize(raw);
    if (z > m) raise_max(z, v);
    sum += exp_shifted(z, ms);
    if (v == c.mask_id) {
      if (kSample) {
        maskv = decode_math::score_of(z, c.temperature, c.key, v);
        maski = v;
      }
    } else if (kSample) {
      offer_score(z, v, c);
    } else if (z > nmv) {
      nmv = z;
      nmi = v;
    }
  }

  // E consecutive elements starting at `base`.
  template <int E>
  DINFER_HD void vector(const float (&z)[E], int32_t base, bool has_mask, const ScanCtx& c) {
    // fmaxf drops NaN, which sanitises to -inf and so can never be a max: vmax is the sanitised
    // maximum unless an element is +inf (or every element is NaN: vmax = NaN compares false below).
    float vmax = z[0];
    DINFER_UNROLL
    for (int j = 1; j < E; ++j) vmax = fmaxf(vmax, z[j]);
    if (vmax == INFINITY || has_mask) {
      DINFER_UNROLL
      for (int j = 0; j < E; ++j) scalar(z[j], base + j, c);
      return;
    }
    // Rare after the first few vectors: a new maximum.
    if (kSample ? vmax > m : vmax > nmv) {
      int32_t j = E - 1;
      DINFER_UNROLL
      for (int k = E - 2; k >= 0; --k) j = z[k] == vmax ? k : j;
      if (!kSample) {
        nmv = vmax;
        nmi = base + j;
      }
      if (vmax > m) raise_max(vmax, base + j);  // nmv <= m, so at T == 0 this nests
    }
    float e[E];
    DINFER_UNROLL
    for (int j = 0; j < E; ++j) e[j] = exp_shifted(z[j], ms);
    DINFER_UNROLL
    for (int w = 1; w < E; w *= 2)  // pairwise: shorter dependency chain, smaller rounding error
      DINFER_UNROLL
      for (int j = 0; j + w < E; j += 2 * w) e[j] += e[j + w];
    if (e[0] != e[0]) {  // a NaN input: NaN -> -inf contributes exp(-inf) = 0
      e[0] = 0.f;
      DINFER_UNROLL
      for (int j = 0; j < E; ++j) e[0] += exp_shifted(decode_math::sanitize(z[j]), ms);
    }
    sum += e[0];
    if (kSample) {
      // Scores z / T + gumbel cost a division, a hash and two logf each. Most tokens cannot win:
      // bound the score with one multiply-add and one MUFU.LG2, evaluate exactly only when the
      // bound reaches the running best (a NaN z or bound also takes the exact path).
      DINFER_UNROLL
      for (int j = 0; j < E; ++j) {
        const uint32_t v = static_cast<uint32_t>(base + j);
        const float bound = fmaf(z[j], c.inv_t, gumbel_upper_bound(decode_math::mix32(c.key ^ v)));
        if (!(bound < thr)) offer_score(decode_math::sanitize(z[j]), base + j, c);
      }
    }
  }

  DINFER_HD Partial partial() const {
    // Nothing but -inf (or no elements): merge as empty, like the CPU backend's all -inf chunks.
    if (m == -INFINITY) return decode_math::empty_partial();
    Partial p;
    p.max = m;
    p.sum = sum;
    p.arg = arg;
    p.nm_score = nmv;
    p.nm_arg = nmi;
    if (kSample) {
      const bool mb = decode_math::beats(maskv, maski, nmv, nmi);
      p.score = mb ? maskv : nmv;
      p.score_arg = mb ? maski : nmi;
    } else {
      p.score = m;
      p.score_arg = arg;
    }
    p.pad = 0;
    return p;
  }
};

// Thread `tid` of `nt` scans elements [c0, c1) of `row`: a scalar head up to the first 16-byte
// boundary (row strides need not be multiples of the vector width), aligned vectors, a scalar tail.
// Per thread, indices increase from head to vectors to tail.
template <class Tag, bool kSample>
DINFER_HD Partial scan_chunk(const typename Tag::Raw* row, int32_t c0, int32_t c1, int tid, int nt,
                             const ScanCtx& c) {
  using Raw = typename Tag::Raw;
  constexpr int E = Tag::kVec;
  ScanState<kSample> st;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(row + c0);
  const int32_t head = static_cast<int32_t>(((16u - (addr & 15u)) & 15u) / sizeof(Raw));
  const int32_t va = c1 - c0 < head ? c1 : c0 + head;
  const int32_t nvec = (c1 - va) / E;
  const int32_t ve = va + nvec * E;
  const int32_t mask_vec = c.mask_id >= va && c.mask_id < ve ? (c.mask_id - va) / E : -1;

  for (int32_t v = c0 + tid; v < va; v += nt) st.scalar(to_float(row[v], Tag{}), v, c);

  const uint4* vp = reinterpret_cast<const uint4*>(row + va);
  for (int32_t i = tid; i < nvec; i += nt * kUnroll) {
    uint4 q[kUnroll];
    DINFER_UNROLL
    for (int u = 0; u < kUnroll; ++u) {  // all loads first: kUnroll requests in flight
      const int32_t k = i + u * nt;
      q[u] = k < nvec ? load_stream(vp + k) : make_uint4(0u, 0u, 0u, 0u);
    }
    DINFER_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int32_t k = i + u * nt;
      if (k < nvec) {
        float z[E];
        unpack(q[u], z, Tag{});
        st.vector(z, va + k * E, k == mask_vec, c);
      }
    }
  }

  for (int32_t v = ve + tid; v < c1; v += nt) st.scalar(to_float(row[v], Tag{}), v, c);
  return st.partial();
}

// ---- CTA reduction -------------------------------------------------------------------------------

__device__ __forceinline__ Partial shfl_down(const Partial& p, int off) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  Partial q;
  q.max = __shfl_down_sync(kAll, p.max, off);
  q.sum = __shfl_down_sync(kAll, p.sum, off);
  q.score = __shfl_down_sync(kAll, p.score, off);
  q.nm_score = __shfl_down_sync(kAll, p.nm_score, off);
  q.arg = __shfl_down_sync(kAll, p.arg, off);
  q.score_arg = __shfl_down_sync(kAll, p.score_arg, off);
  q.nm_arg = __shfl_down_sync(kAll, p.nm_arg, off);
  q.pad = 0;
  return q;
}

// Lane 0's value depends only on in-range lanes (upper lanes merge garbage that nobody reads).
__device__ __forceinline__ Partial warp_reduce(Partial p) {
  DINFER_UNROLL
  for (int off = 16; off > 0; off /= 2) p = decode_math::merge(p, shfl_down(p, off));
  return p;
}

// merge() breaks ties by index, so the reduction order only affects the sum's rounding.
template <int kThreads>
__device__ __forceinline__ Partial block_reduce(Partial p) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && kWarps <= 32, "block must be whole warps, at most 32");
  __shared__ Partial warp_part[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  p = warp_reduce(p);
  if (lane == 0) warp_part[warp] = p;
  __syncthreads();
  if (warp == 0) {
    p = lane < kWarps ? warp_part[lane] : decode_math::empty_partial();
    p = warp_reduce(p);
  }
  return p;  // valid in thread 0
}

// ---- kernels -------------------------------------------------------------------------------------

struct SplitArgs {
  const void* logits;
  int64_t row_stride;  // elements
  int32_t vocab;
  int32_t num_splits;
  int32_t chunk;       // elements per split, a multiple of 8
  int32_t mask_id;     // -1 when outside [0, V)
  float temperature;
  uint32_t seed, offset;
  Partial* partials;   // [N, num_splits]
};

template <class Tag, bool kSample>
__global__ void __launch_bounds__(kSplitThreads) split_pass_kernel(const SplitArgs a) {
  using Raw = typename Tag::Raw;
  // Flattened grid: N can exceed gridDim.y's 65535.
  const int64_t n = blockIdx.x / static_cast<uint32_t>(a.num_splits);
  const int32_t s = static_cast<int32_t>(blockIdx.x % static_cast<uint32_t>(a.num_splits));
  const int32_t c0 = min(s * a.chunk, a.vocab);
  const int32_t c1 = min(c0 + a.chunk, a.vocab);
  const Raw* row = static_cast<const Raw*>(a.logits) + n * a.row_stride;

  ScanCtx c;
  c.mask_id = a.mask_id;
  c.temperature = a.temperature;
  c.inv_t = 1.0f / a.temperature;
  c.key = decode_math::row_key(a.seed, a.offset, static_cast<uint32_t>(n));

  Partial p = scan_chunk<Tag, kSample>(row, c0, c1, threadIdx.x, kSplitThreads, c);
  p = block_reduce<kSplitThreads>(p);
  if (threadIdx.x == 0) a.partials[blockIdx.x] = p;
}

struct FinalizeArgs {
  DecodeStepParams p;
  const Partial* partials;  // [N, num_splits]
  int64_t* fb_token;        // [N] scratch: fallback token per row
  float* fb_conf;           // [N] scratch: its probability (-inf: none)
  int32_t num_splits;
};

// One CTA per sequence. Rows are strided over the threads; the same thread owns a row in every
// phase, so the only cross-thread traffic is phases b and c reading other rows (behind barriers).
__global__ void __launch_bounds__(kFinalizeThreads)
    finalize_kernel(const __grid_constant__ FinalizeArgs a) {
  // Phases b and c walk other rows serially (sequence_stats in one thread, the fixed rule's rank,
  // the hierarchical run scan): from shared memory that is L1 latency instead of L2 per step.
  __shared__ int64_t s_tokens[kStageRows], s_cand[kStageRows];
  __shared__ float s_conf[kStageRows], s_fb_conf[kStageRows];
  __shared__ decode_math::SeqStats s_stats;

  const DecodeStepParams& p = a.p;
  const int64_t b = blockIdx.x;
  const int64_t N = p.num_rows;
  // Bad offsets must not read or write out of bounds: clamp to [0, N] with hi >= lo.
  const int64_t lo = min(max(static_cast<int64_t>(p.seq_offsets[b]), int64_t{0}), N);
  const int64_t hi = min(max(static_cast<int64_t>(p.seq_offsets[b + 1]), lo), N);
  const int64_t L = hi - lo;
  if (L == 0) return;  // uniform per CTA: no thread reaches a barrier
  const bool staged = L <= kStageRows;  // longer sequences read the global copies instead

  const int64_t esize = p.logits_dtype == ScalarType::kFloat32 ? 4 : 2;
  const int S = a.num_splits;

  // a. Per row: combine the splits (in split order) and finalize.
  for (int64_t i = threadIdx.x; i < L; i += kFinalizeThreads) {
    const int64_t n = lo + i;
    const Partial* pp = a.partials + n * S;
    Partial part = pp[0];
    for (int s = 1; s < S; ++s) part = decode_math::merge(part, pp[s]);
    const void* row = static_cast<const char*>(p.logits) + n * p.row_stride * esize;
    const int64_t token = p.tokens[n];
    const decode_math::RowResult r = decode_math::finalize_row(part, row, p, n, token == p.mask_id);
    p.candidate[n] = r.candidate;
    p.confidence[n] = r.confidence;
    p.row_max[n] = r.max;
    p.row_lse[n] = r.lse;
    a.fb_token[n] = r.fallback;
    a.fb_conf[n] = r.fallback_conf;
    if (staged) {
      s_tokens[i] = token;
      s_cand[i] = r.candidate;
      s_conf[i] = r.confidence;
      s_fb_conf[i] = r.fallback_conf;
    }
  }
  __syncthreads();

  // b. Sequence statistics: O(L), serial (L is a block length).
  const int64_t* tokens = staged ? s_tokens : p.tokens + lo;
  const int64_t* cand = staged ? s_cand : p.candidate + lo;
  const float* conf = staged ? s_conf : p.confidence + lo;
  const float* fb_conf = staged ? s_fb_conf : a.fb_conf + lo;
  if (threadIdx.x == 0)
    s_stats = decode_math::sequence_stats(L, tokens, cand, conf, fb_conf, p.mask_id);
  __syncthreads();

  // c. Decisions, from the tokens as they were before this step.
  const decode_math::SeqStats st = s_stats;
  const float tau = p.threshold != nullptr ? p.threshold[b] : 1.0f;
  const int32_t k = p.num_commit != nullptr ? p.num_commit[b] : 0;
  for (int64_t i = threadIdx.x; i < L; i += kFinalizeThreads) {
    const bool c = decode_math::row_commits(i, L, tokens, cand, conf, st, p.rule, tau,
                                            p.low_threshold, k, p.mask_id) ||
                   i == st.fallback_row;
    p.commit[lo + i] = c ? 1 : 0;
  }
  // Every decision has read tokens/candidates of other rows; only now may they change.
  __syncthreads();

  // d. Progress guarantee, then commit. Only the owning thread touches row i here.
  for (int64_t i = threadIdx.x; i < L; i += kFinalizeThreads) {
    const int64_t n = lo + i;
    if (i == st.fallback_row) {
      p.candidate[n] = a.fb_token[n];
      p.confidence[n] = a.fb_conf[n];
    }
    if (p.commit[n]) p.tokens[n] = p.candidate[n];
  }
}

// ---- host side -----------------------------------------------------------------------------------

constexpr size_t align_up(size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

struct Layout {
  size_t partials, fb_token, fb_conf, total;
};

Layout workspace_layout(int64_t num_rows, int num_splits) {
  const size_t n = static_cast<size_t>(num_rows);
  Layout l;
  l.partials = 0;
  l.fb_token = align_up(n * static_cast<size_t>(num_splits) * sizeof(Partial));
  l.fb_conf = align_up(l.fb_token + n * sizeof(int64_t));
  l.total = align_up(l.fb_conf + n * sizeof(float));
  return l;
}

template <class Tag>
void launch_split(const SplitArgs& a, bool sample, unsigned grid, cudaStream_t stream) {
  if (sample)
    split_pass_kernel<Tag, true><<<grid, kSplitThreads, 0, stream>>>(a);
  else
    split_pass_kernel<Tag, false><<<grid, kSplitThreads, 0, stream>>>(a);
}

}  // namespace

size_t decode_step_cuda_workspace_bytes(int64_t num_rows, int64_t vocab) {
  if (num_rows <= 0) return 0;
  return workspace_layout(num_rows, decode_step_num_splits(num_rows, vocab)).total;
}

int decode_step_cuda(const DecodeStepParams& p, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  const int64_t N = p.num_rows, V = p.vocab, B = p.num_seqs;
  if (N < 0 || B < 0) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;  // every sequence is empty: nothing to read or write
  if (V <= 0 || V > kMaxVocab || p.row_stride < V) return cudaErrorInvalidValue;
  if (p.logits == nullptr || p.tokens == nullptr || p.seq_offsets == nullptr ||
      p.candidate == nullptr || p.confidence == nullptr || p.commit == nullptr ||
      p.row_max == nullptr || p.row_lse == nullptr)
    return cudaErrorInvalidValue;
  if (p.num_slots < 0 || (p.num_slots > 0 && (p.credit_ids == nullptr || p.credit_vals == nullptr)))
    return cudaErrorInvalidValue;
  size_t esize;
  switch (p.logits_dtype) {
    case ScalarType::kFloat32: esize = 4; break;
    case ScalarType::kFloat16:
    case ScalarType::kBFloat16: esize = 2; break;
    default: return cudaErrorInvalidValue;
  }
  if (reinterpret_cast<uintptr_t>(p.logits) % esize != 0) return cudaErrorInvalidValue;
  if (p.rule != CommitRule::kThreshold && p.rule != CommitRule::kHierarchical &&
      p.rule != CommitRule::kFixed)
    return cudaErrorInvalidValue;

  const int S = decode_step_num_splits(N, V);
  const Layout l = workspace_layout(N, S);
  if (workspace == nullptr || workspace_bytes < l.total ||
      reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return cudaErrorInvalidValue;
  if (N * S > INT32_MAX || B > INT32_MAX) return cudaErrorInvalidConfiguration;

  char* ws = static_cast<char*>(workspace);
  SplitArgs sa;
  sa.logits = p.logits;
  sa.row_stride = p.row_stride;
  sa.vocab = static_cast<int32_t>(V);
  sa.num_splits = S;
  sa.chunk = static_cast<int32_t>(((V + S - 1) / S + 7) / 8 * 8);
  sa.mask_id = p.mask_id >= 0 && p.mask_id < V ? static_cast<int32_t>(p.mask_id) : -1;
  sa.temperature = p.temperature;
  sa.seed = p.seed;
  sa.offset = p.offset;
  sa.partials = reinterpret_cast<Partial*>(ws + l.partials);

  const bool sample = p.temperature > 0.f;  // NaN temperature: argmax, like the reference
  const unsigned grid = static_cast<unsigned>(N * S);
  switch (p.logits_dtype) {
    case ScalarType::kFloat32: launch_split<F32Tag>(sa, sample, grid, stream); break;
    case ScalarType::kFloat16: launch_split<F16Tag>(sa, sample, grid, stream); break;
    default: launch_split<BF16Tag>(sa, sample, grid, stream); break;
  }

  if (B > 0) {
    FinalizeArgs fa;
    fa.p = p;
    fa.partials = sa.partials;
    fa.fb_token = reinterpret_cast<int64_t*>(ws + l.fb_token);
    fa.fb_conf = reinterpret_cast<float*>(ws + l.fb_conf);
    fa.num_splits = S;
    finalize_kernel<<<static_cast<unsigned>(B), kFinalizeThreads, 0, stream>>>(fa);
  }
  return cudaGetLastError();
}

}  // namespace dinfer_kernels
