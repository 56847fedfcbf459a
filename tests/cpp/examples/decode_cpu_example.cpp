// A C++ runtime calling the decode step with raw pointers: no Python, no torch. The case is
// decode_case.h's, under the threshold rule and the joint rule (row 3 editable, then not).
#include <cstdio>
#include <initializer_list>

#include "decode_case.h"
#include "dinfer_kernels/decode.h"

int main() {
  using namespace decode_case;
  int64_t tokens[kRows], candidate[kRows];
  float confidence[kRows];
  uint8_t commit[kRows];
  const dinfer_kernels::DecodeStepParams p =
      params(&kLogits[0][0], tokens, kOffsets, kThreshold, candidate, confidence, commit);
  for (int i = 0; i < kRows; ++i) tokens[i] = kTokens[i];
  dinfer_kernels::decode_step_cpu(p, 1);
  if (!matches(tokens, confidence, commit, 1e-6f)) return 1;
  for (const uint8_t* editable : {static_cast<const uint8_t*>(nullptr), kRow3NotEditable}) {
    for (int i = 0; i < kRows; ++i) tokens[i] = kTokens[i];
    dinfer_kernels::decode_step_cpu(joint(p, editable), 1);
    if (!matches(tokens, confidence, commit, 1e-6f, editable == nullptr)) return 1;
  }
  std::printf("OK\n");
  return 0;
}
