#include "dinfer_kernels/build_info.h"

#ifndef DINFER_VERSION
#error "DINFER_VERSION must be defined by the build"
#endif

namespace dinfer_kernels {

#ifdef DINFER_WITH_CUDA
bool built_with_cuda() { return true; }
const char* cuda_archs() { return DINFER_CUDA_ARCHS; }
#else
bool built_with_cuda() { return false; }
const char* cuda_archs() { return ""; }
#endif
const char* version() { return DINFER_VERSION; }

}  // namespace dinfer_kernels
