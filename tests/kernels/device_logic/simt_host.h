// A SIMT emulator for the kernels' __host__ __device__ code (the simt.h primitives): one CTA's threads
// run as fibers on the calling thread. A fiber runs until it reaches a barrier (__syncwarp,
// __syncthreads, or the exchange inside a shuffle / match), so every collective sees all lanes'
// values as the hardware would. Deterministic; one CTA at a time.
#pragma once

#include <functional>

namespace dinfer_kernels {
namespace simt {
namespace host {

// Runs `body` as threads 0 .. num_threads - 1 of one CTA (whole warps). Returns false if the
// threads deadlock (a barrier some live thread of its scope never reaches).
bool run_cta(int num_threads, const std::function<void()>& body);

}  // namespace host
}  // namespace simt
}  // namespace dinfer_kernels
