// A C++ runtime calling the CUDA decode step with device buffers and its own stream: no Python, no
// torch. The case is that of the host example (examples/decode_case.h), under the threshold rule and
// then the joint rule (every row editable).
#include <cuda_runtime.h>

#include <cstdio>
#include <initializer_list>

#include "../examples/decode_case.h"
#include "dinfer_kernels/decode.h"

// Each CUDA call of the example: on failure, say which and stop.
#define CHECK(call)                                             \
  do {                                                          \
    const cudaError_t err_ = (call);                            \
    if (err_ != cudaSuccess) {                                  \
      std::printf("%s: %s\n", #call, cudaGetErrorString(err_)); \
      return 1;                                                 \
    }                                                           \
  } while (0)

// n elements on the device, holding src's when given (copied on `stream`).
template <class T>
cudaError_t device_array(T** dst, const T* src, size_t n, cudaStream_t stream) {
  cudaError_t err = cudaMalloc(dst, n * sizeof(T));
  if (err == cudaSuccess && src != nullptr)
    err = cudaMemcpyAsync(*dst, src, n * sizeof(T), cudaMemcpyHostToDevice, stream);
  return err;
}

int main() {
  using namespace decode_case;
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  float *d_logits, *d_threshold, *d_confidence;
  int64_t *d_tokens, *d_candidate;
  int32_t* d_offsets;
  uint8_t *d_commit, *d_workspace;
  CHECK(device_array(&d_logits, &kLogits[0][0], kRows * kVocab, stream));
  CHECK(device_array(&d_tokens, kTokens, kRows, stream));
  CHECK(device_array(&d_offsets, kOffsets, kSeqs + 1, stream));
  CHECK(device_array(&d_threshold, kThreshold, kSeqs, stream));
  CHECK(device_array<int64_t>(&d_candidate, nullptr, kRows, stream));
  CHECK(device_array<float>(&d_confidence, nullptr, kRows, stream));
  CHECK(device_array<uint8_t>(&d_commit, nullptr, kRows, stream));
  const size_t workspace_bytes = dinfer_kernels::decode_step_cuda_workspace_bytes(kRows, kVocab);
  CHECK(device_array<uint8_t>(&d_workspace, nullptr, workspace_bytes, stream));

  const dinfer_kernels::DecodeStepParams p =
      params(d_logits, d_tokens, d_offsets, d_threshold, d_candidate, d_confidence, d_commit);
  int64_t tokens[kRows];
  float confidence[kRows];
  uint8_t commit[kRows];
  for (const bool edits : {false, true}) {
    CHECK(cudaMemcpyAsync(d_tokens, kTokens, sizeof kTokens, cudaMemcpyHostToDevice, stream));
    CHECK(static_cast<cudaError_t>(dinfer_kernels::decode_step_cuda(edits ? joint(p, nullptr) : p,
                                                                    d_workspace, workspace_bytes, stream)));
    CHECK(cudaMemcpyAsync(tokens, d_tokens, sizeof tokens, cudaMemcpyDeviceToHost, stream));
    CHECK(cudaMemcpyAsync(confidence, d_confidence, sizeof confidence, cudaMemcpyDeviceToHost, stream));
    CHECK(cudaMemcpyAsync(commit, d_commit, sizeof commit, cudaMemcpyDeviceToHost, stream));
    CHECK(cudaStreamSynchronize(stream));
    // The device sums exp with the hardware exp2 (a few ulp), the host exactly.
    if (!matches(tokens, confidence, commit, 1e-5f, edits)) return 1;
  }

  for (void* ptr :
       {static_cast<void*>(d_logits), static_cast<void*>(d_tokens), static_cast<void*>(d_offsets),
        static_cast<void*>(d_threshold), static_cast<void*>(d_candidate), static_cast<void*>(d_confidence),
        static_cast<void*>(d_commit), static_cast<void*>(d_workspace)})
    CHECK(cudaFree(ptr));
  CHECK(cudaStreamDestroy(stream));
  std::printf("OK\n");
  return 0;
}
