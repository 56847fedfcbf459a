// dinfer_kernels._C: thin pybind11 bindings over the torch-free launchers. No libtorch: arrays
// arrive through DLPack, so torch, CuPy and NumPy callers share one binary.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include <omp.h>

#include "dinfer_kernels/build_info.h"
#include "dinfer_kernels/cpu_isa.h"

#include "kernel_families.h"

namespace dinfer_bindings {
#define DINFER_DECLARE_REGISTER(op, family, Params, cuda) void register_##family(pybind11::module_& m);
DINFER_KERNEL_FAMILIES(DINFER_DECLARE_REGISTER)
}  // namespace dinfer_bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "dinfer compiled kernels (CPU always; CUDA when built with nvcc)";
  m.def("version", &dinfer_kernels::version);
  m.def("built_with_cuda", &dinfer_kernels::built_with_cuda);
  m.def("cuda_archs", &dinfer_kernels::cuda_archs);
  m.def("omp_max_threads", &omp_get_max_threads);
  // The host kernels' ISA (dinfer_kernels/cpu_isa.h); set_cpu_isa is process-global.
  m.def("cpu_isa", &dinfer_kernels::cpu_isa);
  m.def("cpu_isas_built", &dinfer_kernels::cpu_isas_built);
  m.def("cpu_isas_supported", &dinfer_kernels::cpu_isas_supported);
  m.def("set_cpu_isa", &dinfer_kernels::set_cpu_isa, pybind11::arg("isa"));
  m.def("cpu_isa_fast_ops", &dinfer_kernels::cpu_isa_fast_ops);
#define DINFER_REGISTER(op, family, Params, cuda) dinfer_bindings::register_##family(m);
  DINFER_KERNEL_FAMILIES(DINFER_REGISTER)
  // The ops with a host kernel: every kernel family has one.
#define DINFER_OP_NAME(op, family, Params, cuda) #op,
  m.def("host_kernels", [] { return std::vector<std::string>{DINFER_KERNEL_FAMILIES(DINFER_OP_NAME)}; });
}
