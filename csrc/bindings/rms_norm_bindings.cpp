// pybind11 entry for RMSNorm: validates every argument (dtype, shape, device, strides, eps), then
// calls the torch-free host launcher. Host arrays only: the GPU path is the Triton backend.
#include <cmath>
#include <cstdint>
#include <string>

#include "dinfer_kernels/rms_norm.h"
#include "tensor_arg.h"

namespace dinfer_bindings {

void rms_norm(py::handle x_o, py::handle weight_o, py::handle out_o, py::handle eps_o,
              py::handle num_threads_o) {
  const double eps = float_arg(eps_o, "eps");
  const int num_threads = threads_arg(num_threads_o, "num_threads");
  if (!(eps > 0) || !std::isfinite(static_cast<float>(eps)))
    throw_value_error("eps: must be a finite float32 value > 0, got " + std::to_string(eps));
  TensorArg x(x_o, "x"), weight(weight_o, "weight"), out(out_o, "out");
  x.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  if (x.on_cuda()) throw_value_error("x: host arrays only (the GPU path is the Triton backend)");
  if (x.ndim() != 2) throw_value_error("x: expected a 2-D array [N, D]");
  const int64_t N = x.size(0), D = x.size(1);
  expect_arrays(x, {
                       {&weight, {x.dtype()}, {D}, kContiguous},
                       {&out, {x.dtype()}, {N, D}, kWritable},
                   });
  expect_disjoint({&out}, {&x, &weight}, {{&out, &x}});

  dinfer_kernels::RmsNormParams p;
  p.rows = N;
  p.dim = D;
  p.dtype = scalar_type(x.dtype());
  p.x = x.data<void>();
  leading_strides(x, &p.x_row_stride);
  p.weight = weight.data<void>();
  p.out = out.data<void>();
  leading_strides(out, &p.out_row_stride);
  p.eps = static_cast<float>(eps);
  py::gil_scoped_release release;
  dinfer_kernels::rms_norm_cpu(p, num_threads);
}

void register_rms_norm(py::module_& m) {
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("out"), py::kw_only(), py::arg("eps"),
        py::arg("num_threads") = py::int_(0),
        "RMSNorm of the rows of host x [N, D] (fp32/fp16/bf16, rows contiguous) times weight [D] into "
        "the caller-allocated out [N, D] (may be x itself); contract: "
        "dinfer_kernels/reference/rms_norm.py. Runs on num_threads OpenMP threads (0: OpenMP's "
        "default).");
}

}  // namespace dinfer_bindings
