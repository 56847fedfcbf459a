// The CUDA decode step (csrc/decode/decode.cu) executed on the host, thread by thread: the same
// grid (one CTA per (row, split), one per sequence), the same per-thread functions
// (decode_split.h), the kernel's shuffle-down reduction tree lane by lane, and the finalize phases
// in barrier order. Only the hardware approximations differ: fast_exp2 / fast_log2 are exp2f / log2f
// here (scalar.h). Built and loaded by tests/kernels/test_device_logic.py through ctypes.
#include <cstdint>
#include <memory>
#include <vector>

#include "dinfer_kernels/decode.h"
#include "dinfer_kernels/detail/decode_math.h"
#include "dinfer_kernels/detail/decode_split.h"

namespace {

using namespace dinfer_kernels;
using namespace dinfer_kernels::decode_split;
using decode_math::Partial;

// __shfl_down_sync(p, off) for every lane at once: lane l reads lane l + off, or keeps its own
// value when that is past the warp; then every lane merges, as warp_reduce does.
Partial warp_reduce(Partial (&lane)[kWarpSize]) {
  for (int off = kFirstShuffleOffset; off > 0; off /= 2) {
    Partial next[kWarpSize];
    for (int l = 0; l < kWarpSize; ++l)
      next[l] = decode_math::merge(lane[l], l + off < kWarpSize ? lane[l + off] : lane[l]);
    for (int l = 0; l < kWarpSize; ++l) lane[l] = next[l];
  }
  return lane[0];
}

// block_reduce<kSplitThreads>: each warp's tree, then warp 0's tree over the warps' results.
Partial block_reduce(const Partial (&thread)[kSplitThreads]) {
  constexpr int kWarps = kSplitThreads / kWarpSize;
  Partial warp_part[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    Partial lane[kWarpSize];
    for (int l = 0; l < kWarpSize; ++l) lane[l] = thread[w * kWarpSize + l];
    warp_part[w] = warp_reduce(lane);
  }
  Partial lane[kWarpSize];
  for (int l = 0; l < kWarpSize; ++l) lane[l] = l < kWarps ? warp_part[l] : decode_math::empty_partial();
  return warp_reduce(lane);
}

template <class Tag, bool kSample>
void split_pass(const SplitArgs& a, uint32_t grid) {
  Partial thread[kSplitThreads];
  for (uint32_t cta = 0; cta < grid; ++cta) {
    for (int tid = 0; tid < kSplitThreads; ++tid)
      thread[tid] = split_thread_partial<Tag, kSample>(a, cta, tid);
    a.partials[cta] = block_reduce(thread);
  }
}

template <class Tag>
void split_pass(const SplitArgs& a, bool sample, uint32_t grid) {
  if (sample)
    split_pass<Tag, true>(a, grid);
  else
    split_pass<Tag, false>(a, grid);
}

}  // namespace

// decode_step_cuda's launches for valid arguments (the launcher's checks are not repeated).
extern "C" int dinfer_decode_step_cuda_on_host(
    const void* logits, int32_t dtype, int64_t num_rows, int64_t vocab, int64_t row_stride, int64_t* tokens,
    const int32_t* seq_offsets, int64_t num_seqs, int64_t mask_id, int32_t rule, const float* threshold,
    const int32_t* num_commit, float low_threshold, float temperature, uint32_t seed, uint32_t offset,
    int32_t* credit_ids, float* credit_vals, int32_t num_slots, float alpha, float beta, float gamma,
    int64_t* candidate, float* confidence, uint8_t* commit, uint8_t* nonfinite, const int64_t* row_keys,
    const uint8_t* editable, float edit_threshold) {
  DecodeStepParams p;
  p.logits = logits;
  p.logits_dtype = static_cast<ScalarType>(dtype);
  p.num_rows = num_rows;
  p.vocab = vocab;
  p.row_stride = row_stride;
  p.tokens = tokens;
  p.seq_offsets = seq_offsets;
  p.num_seqs = num_seqs;
  p.mask_id = mask_id;
  p.rule = static_cast<CommitRule>(rule);
  p.threshold = threshold;
  p.num_commit = num_commit;
  p.low_threshold = low_threshold;
  p.temperature = temperature;
  p.seed = seed;
  p.offset = offset;
  p.credit_ids = credit_ids;
  p.credit_vals = credit_vals;
  p.num_slots = num_slots;
  p.credit_alpha = alpha;
  p.credit_beta = beta;
  p.credit_gamma = gamma;
  p.candidate = candidate;
  p.confidence = confidence;
  p.commit = commit;
  p.nonfinite = nonfinite;
  p.row_keys = row_keys;
  p.editable = editable;
  p.edit_threshold = edit_threshold;
  const int64_t N = num_rows, V = vocab;
  if (N == 0) return 0;
  if (V <= 0 || V > kMaxVocab) return 1;

  const int S = decode_step_cuda_num_splits(N, V);
  std::vector<Partial> partials(static_cast<size_t>(N * S));
  const SplitArgs sa = split_args(p, S, partials.data());
  const bool sample = p.temperature > 0.f;
  const uint32_t grid = static_cast<uint32_t>(N * S);
  switch (p.logits_dtype) {
    case ScalarType::kFloat32:
      split_pass<F32Tag>(sa, sample, grid);
      break;
    case ScalarType::kFloat16:
      split_pass<F16Tag>(sa, sample, grid);
      break;
    default:
      split_pass<BF16Tag>(sa, sample, grid);
      break;
  }

  std::vector<int64_t> fb_token(static_cast<size_t>(N));
  std::vector<float> fb_conf(static_cast<size_t>(N));
  FinalizeArgs fa;
  fa.p = p;
  fa.partials = partials.data();
  fa.fb_token = fb_token.data();
  fa.fb_conf = fb_conf.data();
  fa.num_splits = S;
  auto sh = std::make_unique<FinalizeShared>();
  for (int64_t b = 0; b < p.num_seqs; ++b) {  // finalize_kernel, CTA b; a barrier between phases
    const FinalizeSeq q = finalize_seq(fa, b);
    if (q.L == 0) continue;
    for (int tid = 0; tid < kFinalizeThreads; ++tid) finalize_rows(fa, q, *sh, tid);
    const SeqView v = seq_view(fa, q, *sh);
    finalize_stats(fa, q, v, *sh);
    const decode_math::SeqStats st = sh->stats;
    for (int tid = 0; tid < kFinalizeThreads; ++tid) finalize_decide(fa, q, v, st, b, tid);
    for (int tid = 0; tid < kFinalizeThreads; ++tid) finalize_write(fa, q, st, tid);
  }
  return 0;
}
