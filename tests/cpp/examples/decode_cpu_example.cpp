// A C++ runtime calling the decode step with raw pointers: no Python, no torch.
// Two sequences of three block positions over a 5-token vocabulary; token 4 is [MASK].
#include <cmath>
#include <cstdio>

#include "dinfer_kernels/decode.h"

int main() {
  using namespace dinfer_kernels;
  const float logits[6][5] = {{0, 9, 0, 0, 0}, {0, 0, 1, 0, 0}, {0, 0, 0, 0, 9},
                              {3, 0, 0, 0, 0}, {0, 0, 0, 2, 0}, {0, 5, 0, 0, 0}};
  int64_t tokens[6] = {4, 4, 4, 2, 4, 4};
  const int32_t offsets[3] = {0, 3, 6};
  const float threshold[2] = {0.9f, 0.9f};
  int64_t candidate[6];
  float confidence[6], row_max[6], row_lse[6];
  uint8_t commit[6];
  DecodeStepParams p;
  p.logits = logits;
  p.num_rows = 6;
  p.vocab = 5;
  p.row_stride = 5;
  p.tokens = tokens;
  p.seq_offsets = offsets;
  p.num_seqs = 2;
  p.mask_id = 4;
  p.threshold = threshold;
  p.candidate = candidate;
  p.confidence = confidence;
  p.commit = commit;
  p.row_max = row_max;
  p.row_lse = row_lse;
  decode_step_cpu(p, 1);
  // Sequence 0: row 0 is confident (p ~ 0.9995) and commits token 1; row 1 (p ~ 0.4) does not;
  // row 2 predicts [MASK] and never commits. Sequence 1: row 3 is not masked; row 5 (p ~ 0.97)
  // commits, row 4 (p ~ 0.65) does not.
  const int64_t want[6] = {1, 4, 4, 2, 4, 1};
  for (int i = 0; i < 6; ++i)
    if (tokens[i] != want[i]) {
      std::printf("row %d: token %lld, want %lld\n", i, (long long)tokens[i], (long long)want[i]);
      return 1;
    }
  const float p0 = std::exp(9.f) / (std::exp(9.f) + 4.f);
  if (std::fabs(confidence[0] - p0) > 1e-6f || commit[3]) return 1;
  std::printf("OK\n");
  return 0;
}
