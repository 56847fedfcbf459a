// CUDA backend of the fused decode step. Contract: dinfer_kernels/reference/decode.py.
//
// Two launches, no host synchronisation and no allocation (CUDA-graph capturable):
//   1. split_pass_kernel: one CTA per (row, vocabulary split). Streams its chunk of the logits once
//      with 16-byte loads and writes one decode_math::Partial (raw max/argmax/sum-exp, best score,
//      best non-mask score) to the workspace.
//   2. finalize_kernel: one CTA per sequence. Merges each row's partials in split order, then runs
//      the shared decode_math code (credit, fused logits, commit rules, progress guarantee), so
//      everything after the vocabulary pass is the code the CPU tests exercise.
// Both kernels' per-thread code lives in decode_split.h (__host__ __device__), so
// tests/kernels/test_device_logic.py runs it thread by thread on the host with this file's grid and
// reduction trees.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "common/workspace.h"
#include "dinfer_kernels/decode.h"
#include "dinfer_kernels/detail/decode_math.h"
#include "dinfer_kernels/detail/decode_split.h"

namespace dinfer_kernels {
namespace {

using decode_math::Partial;
using namespace decode_split;
using workspace::align_up;

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
  q.nonfinite = __shfl_down_sync(kAll, p.nonfinite, off);
  return q;
}

// Lane 0's value depends only on in-range lanes (upper lanes merge garbage that nobody reads).
__device__ __forceinline__ Partial warp_reduce(Partial p) {
  DINFER_UNROLL
  for (int off = kFirstShuffleOffset; off > 0; off /= 2) p = decode_math::merge(p, shfl_down(p, off));
  return p;
}

// merge() breaks ties by index, so the reduction order only affects the sum's rounding.
template <int kThreads>
__device__ __forceinline__ Partial block_reduce(Partial p) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && kWarps <= 32, "block must be whole warps, at most 32");
  __shared__ Partial warp_part[kWarps];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
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

template <class Tag, bool kSample>
__global__ void __launch_bounds__(kSplitThreads) split_pass_kernel(const SplitArgs a) {
  // Flattened grid: N can exceed gridDim.y's 65535.
  Partial p = split_thread_partial<Tag, kSample>(a, blockIdx.x, threadIdx.x);
  p = block_reduce<kSplitThreads>(p);
  if (threadIdx.x == 0) a.partials[blockIdx.x] = p;
}

// One CTA per sequence. Rows are strided over the threads; the same thread owns a row in every
// phase, so the only cross-thread traffic is phases b and c reading other rows (behind barriers).
__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(const __grid_constant__ FinalizeArgs a) {
  // Phases b and c walk other rows serially (sequence_stats in one thread, the fixed rule's rank,
  // the hierarchical run scan): from shared memory that is L1 latency instead of L2 per step.
  __shared__ FinalizeShared sh;
  const int64_t b = blockIdx.x;
  const FinalizeSeq q = finalize_seq(a, b);
  if (q.L == 0) return;  // uniform per CTA: no thread reaches a barrier
  finalize_rows(a, q, sh, threadIdx.x);
  __syncthreads();
  const SeqView v = seq_view(a, q, sh);
  if (threadIdx.x == 0) finalize_stats(a, q, v, sh);
  __syncthreads();
  const decode_math::SeqStats st = sh.stats;
  finalize_decide(a, q, v, st, b, threadIdx.x);
  // Every decision has read tokens/candidates of other rows; only now may they change.
  __syncthreads();
  finalize_write(a, q, st, threadIdx.x);
}

// ---- host side -----------------------------------------------------------------------------------

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
  return workspace_layout(num_rows, decode_step_cuda_num_splits(num_rows, vocab)).total;
}

int decode_step_cuda(const DecodeStepParams& p, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  const int64_t N = p.num_rows, V = p.vocab, B = p.num_seqs;
  if (N < 0 || B < 0) return cudaErrorInvalidValue;
  if (N == 0) return cudaSuccess;  // every sequence is empty: nothing to read or write
  if (V <= 0 || V > kMaxVocab || p.row_stride < V) return cudaErrorInvalidValue;
  if (p.logits == nullptr || p.tokens == nullptr || p.seq_offsets == nullptr || p.candidate == nullptr ||
      p.confidence == nullptr || p.commit == nullptr)
    return cudaErrorInvalidValue;
  if (p.num_slots < 0 || (p.num_slots > 0 && (p.credit_ids == nullptr || p.credit_vals == nullptr)))
    return cudaErrorInvalidValue;
  size_t esize;
  switch (p.logits_dtype) {
    case ScalarType::kFloat32:
      esize = 4;
      break;
    case ScalarType::kFloat16:
    case ScalarType::kBFloat16:
      esize = 2;
      break;
    default:
      return cudaErrorInvalidValue;
  }
  if (reinterpret_cast<uintptr_t>(p.logits) % esize != 0) return cudaErrorInvalidValue;
  if (p.rule != CommitRule::kThreshold && p.rule != CommitRule::kHierarchical &&
      p.rule != CommitRule::kFixed && p.rule != CommitRule::kJoint)
    return cudaErrorInvalidValue;

  const int S = decode_step_cuda_num_splits(N, V);
  const Layout l = workspace_layout(N, S);
  if (workspace == nullptr || workspace_bytes < l.total || !workspace::aligned16(workspace))
    return cudaErrorInvalidValue;
  if (N * S > INT32_MAX || B > INT32_MAX) return cudaErrorInvalidConfiguration;

  char* ws = static_cast<char*>(workspace);
  const SplitArgs sa = split_args(p, S, reinterpret_cast<Partial*>(ws + l.partials));

  const bool sample = p.temperature > 0.f;  // NaN temperature: argmax, like the reference
  const unsigned grid = static_cast<unsigned>(N * S);
  switch (p.logits_dtype) {
    case ScalarType::kFloat32:
      launch_split<F32Tag>(sa, sample, grid, stream);
      break;
    case ScalarType::kFloat16:
      launch_split<F16Tag>(sa, sample, grid, stream);
      break;
    default:
      launch_split<BF16Tag>(sa, sample, grid, stream);
      break;
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
