// The CUDA decode step (csrc/decode/decode.cu) executed on the host: the same persistent unit walk
// (CTA c of a grid of G takes units c, c + G, ...) with the CTAs' units interleaved in a seeded order,
// the same per-thread functions (decode_split.h), the kernel's shuffle-down reduction tree lane by
// lane, the row tickets and the last CTA's merge, and the finalize kernel's CTAs run whole by the
// SIMT emulator (simt_host.h). Only the hardware approximations differ: fast_exp2 / fast_log2 are
// exp2f / log2f here (scalar.h). Built and loaded by tests/kernels/test_device_logic.py through ctypes.
#include <cstdint>
#include <memory>
#include <vector>

#include "dinfer_kernels/decode.h"
#include "dinfer_kernels/detail/decode_math.h"
#include "dinfer_kernels/detail/decode_split.h"
#include "simt_host.h"

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

// One unit of split_pass_kernel: every thread's partial, the CTA reduction, thread 0's ticket, and
// for the row's last unit the staging (every thread) and the merge (thread 0).
template <class Tag, bool kSample>
void run_unit(const SplitArgs& a, const FinalizeArgs& f, uint32_t u) {
  Partial thread[kSplitThreads];
  for (int tid = 0; tid < kSplitThreads; ++tid) thread[tid] = split_thread_partial<Tag, kSample>(a, u, tid);
  if (!publish_unit(f, u, block_reduce(thread))) return;
  const int64_t n = u / static_cast<uint32_t>(a.num_splits);
  Partial staged[kMaxSplits];
  for (int tid = 0; tid < kSplitThreads; ++tid) stage_row_partials(f, n, tid, staged);
  finalize_row_of(f, n, staged);
}

// The persistent grid of `grid` CTAs. order 0: units in increasing order (CTAs take turns);
// otherwise a seeded random interleaving that keeps each CTA's own units in its walk order, so rows
// are completed, and merged, by varying CTAs.
template <class Tag, bool kSample>
void split_pass(const SplitArgs& a, const FinalizeArgs& f, uint32_t grid, uint32_t order) {
  if (order == 0) {
    for (uint32_t u = 0; u < a.num_units; ++u) run_unit<Tag, kSample>(a, f, u);
    return;
  }
  std::vector<uint32_t> next;  // next unit of each CTA with units left
  for (uint32_t c = 0; c < grid && c < a.num_units; ++c) next.push_back(c);
  uint32_t state = order;
  while (!next.empty()) {
    state = decode_math::mix32(state + 0x9E3779B9u);
    const size_t k = state % next.size();
    run_unit<Tag, kSample>(a, f, next[k]);
    next[k] += grid;
    if (next[k] >= a.num_units) {
      next[k] = next.back();
      next.pop_back();
    }
  }
}

template <class Tag>
void split_pass(const SplitArgs& a, const FinalizeArgs& f, bool sample, uint32_t grid, uint32_t order) {
  if (sample)
    split_pass<Tag, true>(a, f, grid, order);
  else
    split_pass<Tag, false>(a, f, grid, order);
}

}  // namespace

// decode_step_cuda's launches for valid arguments (the launcher's checks are not repeated), with a
// persistent grid of `grid` CTAs (0: 660, an H200's 132 SMs x 5 slots) and CTA interleaving `order`.
// Returns 0, 1 for a vocabulary out of range, 2 if a finalize CTA deadlocks at a barrier.
extern "C" int dinfer_decode_step_cuda_on_host(
    const void* logits, int32_t dtype, int64_t num_rows, int64_t vocab, int64_t row_stride, int64_t* tokens,
    const int32_t* seq_offsets, int64_t num_seqs, int64_t mask_id, int32_t rule, const float* threshold,
    const int32_t* num_commit, float low_threshold, float temperature, uint32_t seed, uint32_t offset,
    int32_t* credit_ids, float* credit_vals, int32_t num_slots, float alpha, float beta, float gamma,
    int64_t* candidate, float* confidence, uint8_t* commit, uint8_t* nonfinite, const int64_t* row_keys,
    const uint8_t* editable, float edit_threshold, uint32_t grid, uint32_t order) {
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
  std::vector<int32_t> tickets(static_cast<size_t>(N), 0);  // the launcher's memset
  std::vector<int64_t> fb_token(static_cast<size_t>(N));
  std::vector<float> fb_conf(static_cast<size_t>(N));
  const SplitArgs sa = split_args(p, S, partials.data());
  FinalizeArgs fa;
  fa.p = p;
  fa.partials = partials.data();
  fa.tickets = tickets.data();
  fa.fb_token = fb_token.data();
  fa.fb_conf = fb_conf.data();
  fa.num_splits = S;

  const bool sample = p.temperature > 0.f;
  if (grid == 0) grid = 660;
  switch (p.logits_dtype) {
    case ScalarType::kFloat32:
      split_pass<F32Tag>(sa, fa, sample, grid, order);
      break;
    case ScalarType::kFloat16:
      split_pass<F16Tag>(sa, fa, sample, grid, order);
      break;
    default:
      split_pass<BF16Tag>(sa, fa, sample, grid, order);
      break;
  }

  auto sh = std::make_unique<FinalizeShared>();
  for (int64_t b = 0; b < p.num_seqs; ++b) {  // finalize_kernel, CTA b
    const bool ok =
        simt::host::run_cta(kFinalizeThreads, [&] { finalize_cta(fa, *sh, b, simt::thread_index()); });
    if (!ok) return 2;
  }
  return 0;
}
