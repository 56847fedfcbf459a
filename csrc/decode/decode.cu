// CUDA backend of the fused decode step. Contract: dinfer_kernels/reference/decode.py.
//
// A memset and two launches, no host synchronisation and no allocation (CUDA-graph capturable):
//   0. the per-row tickets of the workspace are zeroed (a memset node inside a captured graph).
//   1. split_pass_kernel: a persistent grid of exactly the resident CTA slots walks (row, vocabulary
//      split) units of <= 32 KB of 16-bit logits: no wave tail beyond one unit. Each unit streams its
//      chunk once with 16-byte loads and publishes one decode_math::Partial (raw max/argmax/sum-exp,
//      best score, best non-mask score); the CTA that completes a row (an atomic ticket per row)
//      merges the row's partials in split order and finalizes the row (credit, fused logits) with
//      the shared decode_math code. The grid size never changes a result: the merge order is fixed.
//   2. finalize_kernel: one CTA per sequence: the per-sequence statistics as a block reduction, the
//      commit rules and the progress guarantee, rows in parallel.
// Both kernels' per-thread code lives in decode_split.h (__host__ __device__), so
// tests/kernels/test_device_logic.py runs it on the host with this file's unit walk, reduction trees
// and barriers, in several CTA orders.
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
__global__ void __launch_bounds__(kSplitThreads)
    split_pass_kernel(const SplitArgs a, const __grid_constant__ FinalizeArgs f) {
  __shared__ Partial staged[kMaxSplits];
  __shared__ bool last;
  for (uint32_t u = blockIdx.x; u < a.num_units; u += gridDim.x) {
    Partial p = split_thread_partial<Tag, kSample>(a, u, threadIdx.x);
    p = block_reduce<kSplitThreads>(p);
    if (threadIdx.x == 0) {
      const bool is_last = publish_unit(f, u, p);
      if (is_last) __threadfence();  // acquire: the other CTAs' partials, before the barrier below
      last = is_last;
    }
    __syncthreads();
    if (last) {  // uniform per CTA
      const int64_t n = u / static_cast<uint32_t>(a.num_splits);
      stage_row_partials(f, n, threadIdx.x, staged);
      __syncthreads();
      if (threadIdx.x == 0) finalize_row_of(f, n, staged);
    }
    __syncthreads();  // `last`, `staged` and block_reduce's shared words are reused by the next unit
  }
}

__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(const __grid_constant__ FinalizeArgs a) {
  // Phases b and c read other rows: from shared memory that is L1 latency instead of L2 per step.
  __shared__ FinalizeShared sh;
  finalize_cta(a, sh, blockIdx.x, threadIdx.x);
}

// ---- host side -----------------------------------------------------------------------------------

struct Layout {
  size_t partials, tickets, fb_token, fb_conf, total;
};

Layout workspace_layout(int64_t num_rows, int num_splits) {
  const size_t n = static_cast<size_t>(num_rows);
  Layout l;
  l.partials = 0;
  l.tickets = align_up(n * static_cast<size_t>(num_splits) * sizeof(Partial));
  l.fb_token = align_up(l.tickets + n * sizeof(int32_t));
  l.fb_conf = align_up(l.fb_token + n * sizeof(int64_t));
  l.total = align_up(l.fb_conf + n * sizeof(float));
  return l;
}

// Resident CTA slots of a kernel on the current device: host-side queries only, so a captured graph
// records nothing for them. A grid of exactly the slots never waits for a second wave.
int resident_slots(const void* kernel, int& slots) {
  int dev = 0, sms = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kSplitThreads, 0);
  slots = sms * (per_sm > 0 ? per_sm : 1);
  return e;
}

template <class Tag, bool kSample>
int launch_split(const SplitArgs& a, const FinalizeArgs& f, cudaStream_t stream) {
  int slots = 0;
  const int e = resident_slots(reinterpret_cast<const void*>(&split_pass_kernel<Tag, kSample>), slots);
  if (e != cudaSuccess) return e;
  const unsigned grid =
      a.num_units < static_cast<uint32_t>(slots) ? a.num_units : static_cast<unsigned>(slots);
  split_pass_kernel<Tag, kSample><<<grid, kSplitThreads, 0, stream>>>(a, f);
  return cudaSuccess;
}

template <class Tag>
int launch_split(const SplitArgs& a, const FinalizeArgs& f, bool sample, cudaStream_t stream) {
  return sample ? launch_split<Tag, true>(a, f, stream) : launch_split<Tag, false>(a, f, stream);
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
  FinalizeArgs fa;
  fa.p = p;
  fa.partials = sa.partials;
  fa.tickets = reinterpret_cast<int32_t*>(ws + l.tickets);
  fa.fb_token = reinterpret_cast<int64_t*>(ws + l.fb_token);
  fa.fb_conf = reinterpret_cast<float*>(ws + l.fb_conf);
  fa.num_splits = S;

  cudaError_t e = cudaMemsetAsync(fa.tickets, 0, static_cast<size_t>(N) * sizeof(int32_t), stream);
  if (e != cudaSuccess) return e;
  const bool sample = p.temperature > 0.f;  // NaN temperature: argmax, like the reference
  int le;
  switch (p.logits_dtype) {
    case ScalarType::kFloat32:
      le = launch_split<F32Tag>(sa, fa, sample, stream);
      break;
    case ScalarType::kFloat16:
      le = launch_split<F16Tag>(sa, fa, sample, stream);
      break;
    default:
      le = launch_split<BF16Tag>(sa, fa, sample, stream);
      break;
  }
  if (le != cudaSuccess) return le;
  if (B > 0) finalize_kernel<<<static_cast<unsigned>(B), kFinalizeThreads, 0, stream>>>(fa);
  return cudaGetLastError();
}

}  // namespace dinfer_kernels
