// pybind11 entry for the rotary embedding: validates every argument (dtype, shape, device, strides,
// rotary_dim, and every position against the table), then calls the torch-free host launcher. Host
// arrays only: the GPU path is the Triton backend.
#include <cstdint>
#include <string>

#include "dinfer_kernels/rope.h"
#include "tensor_arg.h"

namespace dinfer_bindings {

void rope(py::handle x_o, py::handle positions_o, py::handle cos_sin_o, py::handle out_o,
          py::handle num_threads_o) {
  const int num_threads = threads_arg(num_threads_o, "num_threads");
  TensorArg x(x_o, "x"), positions(positions_o, "positions"), cos_sin(cos_sin_o, "cos_sin"),
      out(out_o, "out");
  x.expect_dtype({DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  if (x.on_cuda()) throw_value_error("x: host arrays only (the GPU path is the Triton backend)");
  if (x.ndim() != 4) throw_value_error("x: expected a 4-D array [B, T, H, D]");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
  expect_arrays(x, {
                       {&positions, {DType::kInt64}, {B, T}, kContiguous},
                       {&cos_sin, {DType::kFloat32}, {-1, -1}, kContiguous},  // [table_len, rotary_dim]
                       {&out, {x.dtype()}, {B, T, H, D}, kWritable},
                   });
  const int64_t P = cos_sin.size(0), rd = cos_sin.size(1);
  if (rd < 2 || rd % 2 != 0 || rd > D)
    throw_value_error("cos_sin: rotary_dim (its second dim, " + std::to_string(rd) +
                      ") must be even and in [2, D=" + std::to_string(D) + "]");
  expect_disjoint({&out}, {&x, &positions, &cos_sin}, {{&out, &x}});
  const int64_t* pos = positions.data<int64_t>();
  for (int64_t i = 0; i < B * T; ++i)
    if (pos[i] < 0 || pos[i] >= P)
      throw_value_error("positions: position " + std::to_string(pos[i]) + " at row " + std::to_string(i) +
                        " is outside the table [0, " + std::to_string(P) + ")");

  dinfer_kernels::RopeParams p;
  p.batch = B;
  p.tokens = T;
  p.heads = H;
  p.head_dim = D;
  p.rotary_dim = rd;
  p.dtype = scalar_type(x.dtype());
  p.x = x.data<void>();
  leading_strides(x, p.x_stride);
  p.positions = pos;
  p.cos_sin = cos_sin.data<float>();
  p.table_len = P;
  p.out = out.data<void>();
  leading_strides(out, p.out_stride);
  py::gil_scoped_release release;
  dinfer_kernels::rope_cpu(p, num_threads);
}

void register_rope(py::module_& m) {
  m.def("rope", &rope, py::arg("x"), py::arg("positions"), py::arg("cos_sin"), py::arg("out"), py::kw_only(),
        py::arg("num_threads") = py::int_(0),
        "Rotate-half rotary embedding of host x [B, T, H, D] (fp32/fp16/bf16, last dim contiguous) at "
        "positions [B, T] int64, angles from cos_sin [table_len, rotary_dim] fp32 (row p: cos, then "
        "sin, of p * inv_freq), into the caller-allocated out [B, T, H, D] (may be x itself); "
        "contract: dinfer_kernels/reference/rope.py. Runs on num_threads OpenMP threads (0: "
        "OpenMP's default).");
}

}  // namespace dinfer_bindings
