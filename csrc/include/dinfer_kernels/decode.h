// Fused diffusion decode step: torch-free C++ launchers (host and CUDA).
//
// A C++ runtime links libdinfer_kernels (or the Python extension's object files) and calls these with
// raw pointers plus a stream. The contract (shapes, dtypes, edge cases) is the pure-torch reference
// dinfer_kernels/reference/decode.py; every pointer below mirrors one argument there.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "dinfer_kernels/types.h"

namespace dinfer_kernels {

// kJoint: LLaDA2.1's JointThreshold, the threshold rule on the masked rows plus token-to-token edits
// of the committed ones (DecodeStepParams::editable, edit_threshold).
enum class CommitRule : int32_t { kThreshold = 0, kHierarchical = 1, kFixed = 2, kJoint = 3 };

struct DecodeStepParams {
  // ---- inputs -------------------------------------------------------------------------------
  const void* logits = nullptr;  // [num_rows, vocab], element (n, v) at n * row_stride + v
  ScalarType logits_dtype = ScalarType::kFloat32;
  int64_t num_rows = 0;  // N
  int64_t vocab = 0;  // V
  int64_t row_stride = 0;  // in elements, >= vocab
  int64_t* tokens = nullptr;  // [N] in/out: committed positions get their candidate
  const int32_t* seq_offsets = nullptr;  // [num_seqs + 1], rows of sequence b: [off[b], off[b+1])
  int64_t num_seqs = 0;  // B
  int64_t mask_id = 0;
  CommitRule rule = CommitRule::kThreshold;
  const float* threshold = nullptr;  // [B]: tau (threshold, joint) or tau_high (hierarchical)
  const int32_t* num_commit = nullptr;  // [B]: k (fixed); may be null for the other rules
  float low_threshold = 0.4f;  // tau_low (hierarchical)
  float temperature = 0.0f;  // 0: argmax; > 0: Gumbel-max sampling
  uint32_t seed = 0, offset = 0;  // counter-based RNG key (reference/rng.py)
  const int64_t* row_keys = nullptr;  // [N] noise key of each row (low 32 bits); null: the row index
  // ---- token-to-token edits (kJoint only) ------------------------------------------------------
  // A row not masked, editable, whose candidate is neither the mask token nor its token, is rewritten
  // when its confidence > edit_threshold (compared in fp32, like every confidence).
  const uint8_t* editable = nullptr;  // [N] (bool) rows that may be rewritten; null: every row
  float edit_threshold = INFINITY;  // +inf: editing off
  // ---- sparse credit (num_slots == 0 disables it) ----------------------------------------------
  int32_t* credit_ids = nullptr;  // [N, num_slots] in/out, -1 = empty slot
  float* credit_vals = nullptr;  // [N, num_slots] in/out
  int32_t num_slots = 0;  // K
  float credit_alpha = 0.7f, credit_beta = 0.8f, credit_gamma = 0.2f;
  // ---- outputs (caller-allocated) --------------------------------------------------------------
  int64_t* candidate = nullptr;  // [N]
  float* confidence = nullptr;  // [N]
  uint8_t* commit = nullptr;  // [N] (bool)
  uint8_t* nonfinite = nullptr;  // [N] (bool) the raw row holds a NaN or +-inf; may be null
};

// Vocabulary splits per row used by the CUDA kernels: a pure function of (N, V), so results never
// depend on the GPU model. A (row, split) unit is the persistent grid's work item: 16384 elements
// (32 KB of 16-bit logits) or fewer below V = 2^20, so the grid's last round is a small share of the
// time at large N; at small N enough units for ~4 waves of 132 SMs, chunks of >= 2048 tokens.
constexpr int kDecodeStepMaxSplits = 64;
inline int decode_step_cuda_num_splits(int64_t num_rows, int64_t vocab) {
  const int64_t target_ctas = 528;
  const int64_t unit_elems = 16384;
  int64_t by_rows = num_rows > 0 ? (target_ctas + num_rows - 1) / num_rows : 1;
  int64_t by_vocab = (vocab + 2047) / 2048;
  int64_t by_unit = (vocab + unit_elems - 1) / unit_elems;
  int64_t s = by_rows < by_vocab ? by_rows : by_vocab;
  if (s < by_unit) s = by_unit;
  if (s < 1) s = 1;
  if (s > kDecodeStepMaxSplits) s = kDecodeStepMaxSplits;
  return static_cast<int>(s);
}

// Bytes of device workspace decode_step_cuda needs (partials of every split plus per-row scratch).
size_t decode_step_cuda_workspace_bytes(int64_t num_rows, int64_t vocab);

// On `stream`: zeroes the per-row tickets, then launches the persistent vocabulary pass (its rows'
// last CTAs merge and finalize them) and the per-sequence finalize. Never synchronises; capturable.
// Returns 0 (cudaSuccess) or the cudaError_t of the launch.
int decode_step_cuda(const DecodeStepParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Host implementation (OpenMP over rows and vocabulary chunks). num_threads <= 0: OpenMP default.
void decode_step_cpu(const DecodeStepParams& p, int num_threads);

}  // namespace dinfer_kernels
