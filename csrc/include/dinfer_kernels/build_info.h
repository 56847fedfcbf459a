// What a build of the compiled layer contains.
#pragma once

namespace dinfer_kernels {

bool built_with_cuda();  // the CUDA kernels are in this build
const char* cuda_archs();  // e.g. "80;90a"; "" without CUDA
const char* version();

}  // namespace dinfer_kernels
