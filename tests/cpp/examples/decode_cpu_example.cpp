// A C++ runtime calling the decode step with raw pointers: no Python, no torch. The case is
// decode_case.h's.
#include <cstdio>

#include "decode_case.h"
#include "dinfer_kernels/decode.h"

int main() {
  using namespace decode_case;
  int64_t tokens[kRows], candidate[kRows];
  float confidence[kRows];
  uint8_t commit[kRows];
  for (int i = 0; i < kRows; ++i) tokens[i] = kTokens[i];
  dinfer_kernels::decode_step_cpu(
      params(&kLogits[0][0], tokens, kOffsets, kThreshold, candidate, confidence, commit), 1);
  if (!matches(tokens, confidence, commit, 1e-6f)) return 1;
  std::printf("OK\n");
  return 0;
}
