// The case of the decode examples (host and CUDA): two sequences of three block positions over a
// 5-token vocabulary; token 4 is [MASK]. Sequence 0: row 0 is confident (p ~ 0.9995) and commits
// token 1; row 1 (p ~ 0.4) does not; row 2 predicts [MASK] and never commits. Sequence 1: row 3 is
// not masked; row 5 (p ~ 0.97) commits, row 4 (p ~ 0.65) does not. Under the joint rule (LLaDA2.1's
// JointThreshold, edit threshold 0.8) row 3 (token 2, confident in token 0: p ~ 0.834) is rewritten
// to token 0 too, unless it is not editable.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "dinfer_kernels/decode.h"

namespace decode_case {

constexpr int kRows = 6, kVocab = 5, kSeqs = 2;
const float kLogits[kRows][kVocab] = {{0, 9, 0, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 0, 0, 9},
                                      {3, 0, 0, 0, 0}, {0, 0, 0, 2, 0}, {0, 5, 0, 0, 0}};
const int64_t kTokens[kRows] = {4, 4, 4, 2, 4, 4};
const int32_t kOffsets[kSeqs + 1] = {0, 3, 6};
const float kThreshold[kSeqs] = {0.9f, 0.9f};
constexpr float kEditThreshold = 0.8f;
const uint8_t kRow3NotEditable[kRows] = {1, 1, 1, 0, 1, 1};

// The step's parameters over the case's arrays, wherever they live (host or device).
inline dinfer_kernels::DecodeStepParams params(const float* logits, int64_t* tokens, const int32_t* offsets,
                                               const float* threshold, int64_t* candidate, float* confidence,
                                               uint8_t* commit) {
  dinfer_kernels::DecodeStepParams p;
  p.logits = logits;
  p.num_rows = kRows;
  p.vocab = kVocab;
  p.row_stride = kVocab;
  p.tokens = tokens;
  p.seq_offsets = offsets;
  p.num_seqs = kSeqs;
  p.mask_id = 4;
  p.threshold = threshold;
  p.candidate = candidate;
  p.confidence = confidence;
  p.commit = commit;
  return p;
}

// The same step under the joint rule: editable (null: every row) over the case's arrays.
inline dinfer_kernels::DecodeStepParams joint(dinfer_kernels::DecodeStepParams p, const uint8_t* editable) {
  p.rule = dinfer_kernels::CommitRule::kJoint;
  p.editable = editable;
  p.edit_threshold = kEditThreshold;
  return p;
}

// Whether the results (copied to the host) match the case, printing what does not: rows 0 and 5
// commit token 1, row 3 token 0 when `edited` (the joint rule, row 3 editable), nothing else changes,
// and row 0's confidence is within `tol` of exp(9) / (exp(9) + 4).
inline bool matches(const int64_t* tokens, const float* confidence, const uint8_t* commit, float tol,
                    bool edited = false) {
  const int64_t want[kRows] = {1, 4, 4, edited ? 0 : 2, 4, 1};
  for (int i = 0; i < kRows; ++i)
    if (tokens[i] != want[i]) {
      std::printf("row %d: token %lld, want %lld\n", i, (long long)tokens[i], (long long)want[i]);
      return false;
    }
  const float p0 = std::exp(9.f) / (std::exp(9.f) + 4.f);
  if (std::fabs(confidence[0] - p0) > tol || commit[3] != edited) {
    std::printf("row 0: confidence %.8f, want %.8f; row 3 commit %d\n", confidence[0], p0, commit[3]);
    return false;
  }
  return true;
}

}  // namespace decode_case
