// A borrowed view of any `__dlpack__` object (torch, CuPy, NumPy) or of a DLPack capsule, plus
// argument checks that raise Python TypeError/ValueError naming the argument -- the bindings never
// trust their inputs.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>

#include "dinfer_kernels/types.h"
#include "dlpack_abi.h"

namespace dinfer_bindings {

namespace py = pybind11;

enum class DType { kFloat32, kFloat16, kBFloat16, kFloat8E4M3, kInt32, kInt64, kUInt8, kBool, kOther };
const char* dtype_name(DType t);

class TensorArg {
 public:
  // Imports `obj` through DLPack (a capsule is consumed as it is). CUDA producers are asked for no
  // stream synchronisation: the caller passes the stream its tensors were produced on.
  TensorArg(py::handle obj, std::string name);
  ~TensorArg();
  TensorArg(const TensorArg&) = delete;
  TensorArg& operator=(const TensorArg&) = delete;

  const std::string& name() const { return name_; }
  DType dtype() const { return dtype_; }
  int ndim() const { return t_->ndim; }
  int64_t size(int d) const { return t_->shape[d]; }
  int64_t stride(int d) const;  // in elements
  int64_t numel() const;
  bool on_cuda() const { return t_->device.device_type != dlpack::kCPU; }
  int device_id() const { return t_->device.device_id; }
  template <typename T>
  T* data() const {
    return reinterpret_cast<T*>(static_cast<char*>(t_->data) + t_->byte_offset);
  }

  // Checks; each throws with the argument's name in the message.
  void expect_dtype(std::initializer_list<DType> allowed) const;
  void expect_shape(std::initializer_list<int64_t> dims) const;  // -1: any size
  void expect_contiguous() const;  // compact row-major
  void expect_writable() const;
  void expect_same_device(const TensorArg& other) const;

  // The bytes the elements span, [lo, hi) from data + byte_offset over every stride sign; an empty
  // array spans nothing (lo == hi).
  int64_t elem_bytes() const;
  uintptr_t byte_lo() const;
  uintptr_t byte_hi() const;
  // The same elements in the same order: one base, dtype, shape and strides (of dims of size > 1).
  bool same_view(const TensorArg& other) const;

 private:
  static bool supported_device(int dev_type);
  [[noreturn]] void throw_device_error(int dev_type) const;
  void release();

  std::string name_;
  dlpack::Tensor* t_ = nullptr;
  void* managed_ = nullptr;
  bool versioned_ = false;
  bool readonly_ = false;
  DType dtype_ = DType::kOther;
};

// An optional array argument: null for None.
std::unique_ptr<TensorArg> optional_arg(py::handle obj, const char* name);

// A binding's argument checks are one table of expectations (expect_arrays), one row per array
// whose dims follow from the lead array's: its dtypes, its shape and its layout.
enum ArrayFlags : unsigned { kContiguous = 1, kWritable = 2 };
struct ArrayExpect {
  const TensorArg* array;  // nullptr: an absent optional array (skipped)
  std::initializer_list<DType> dtypes;  // empty: any
  std::initializer_list<int64_t> shape;  // empty: any; -1: any size of that dim
  unsigned flags = 0;  // kContiguous | kWritable
};
// Checks each row in order (dtype, shape, contiguity, writability), then that every array is on
// `lead`'s device; the first failing check throws, naming its array.
void expect_arrays(const TensorArg& lead, std::initializer_list<ArrayExpect> table);

[[noreturn]] void throw_value_error(const std::string& msg);
[[noreturn]] void throw_type_error(const std::string& msg);

// Refuses any byte shared by an array the op writes and another array of the call, on one device:
// the kernels read their inputs while writing in parallel and in no set order, so an overlap gives
// wrong values. `inplace` lists the (written, read) pairs the op documents as in-place, which may be
// exactly the same view (and no other overlap). nullptr entries (absent optional arrays) are skipped.
struct InPlace {
  const TensorArg* written;
  const TensorArg* read;
};
void expect_disjoint(std::initializer_list<const TensorArg*> written,
                     std::initializer_list<const TensorArg*> read,
                     std::initializer_list<InPlace> inplace = {});

// Scalars arrive as Python objects so that a wrong type is reported with the argument's name.
// numbers.Integral / numbers.Real (NumPy scalars too) are taken like int / float; bool is refused.
int64_t int_arg(py::handle o, const char* name);
double float_arg(py::handle o, const char* name);
bool bool_arg(py::handle o, const char* name);
// An OpenMP thread count for the host kernels: 0 (OpenMP's default) to 4096.
int threads_arg(py::handle o, const char* name);

// The strides of the leading ndim - 1 dimensions of an array whose last dimension must be contiguous
// (stride 1; else the error names the array), into out[0, ndim - 1). Size-1 dimensions get 0 (their
// stride is never used), and an empty array all 0.
void leading_strides(const TensorArg& t, int64_t* out);

// The kernels' element type of a float array whose dtype was checked to be fp32, fp16, bf16 or
// float8_e4m3fn.
dinfer_kernels::ScalarType scalar_type(DType t);

// The workspace of a CUDA launch that needs `need` bytes: `workspace_o` checked to be a uint8,
// contiguous, writable, 16-byte aligned array of at least `need` bytes on `lead`'s device, sharing no
// byte with `arrays`. Null when need is 0 (then `workspace_o` may be None and is not looked at).
// `query` names the binding that tells the size.
std::unique_ptr<TensorArg> cuda_workspace(py::handle workspace_o, size_t need, const char* query,
                                          const TensorArg& lead,
                                          std::initializer_list<const TensorArg*> arrays);

// The CUDA branch of a binding whose arrays (`lead`, the first of them) are on a CUDA device: the
// workspace of need() bytes (cuda_workspace), then launch(workspace data, need, stream) with the GIL
// released; a non-zero result (a cudaError_t) is raised naming `launcher`. A build without the CUDA
// kernels refuses the arrays instead, and calls neither (their CUDA launchers do not exist there).
template <class Need, class Launch>
void run_cuda(const char* launcher, const char* query, const TensorArg& lead, py::handle workspace_o,
              int64_t stream, std::initializer_list<const TensorArg*> arrays, Need need, Launch launch) {
#ifdef DINFER_WITH_CUDA
  const size_t bytes = need();
  const std::unique_ptr<TensorArg> workspace = cuda_workspace(workspace_o, bytes, query, lead, arrays);
  void* data = workspace ? workspace->data<void>() : nullptr;
  int err;
  {
    py::gil_scoped_release release;
    err = launch(data, bytes, reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream)));
  }
  if (err != 0) throw std::runtime_error(std::string(launcher) + ": CUDA error " + std::to_string(err));
#else
  (void)launcher, (void)query, (void)workspace_o, (void)stream, (void)arrays, (void)need, (void)launch;
  throw_value_error(lead.name() +
                    ": CUDA arrays need a CUDA build of dinfer_kernels (this one has the host kernels only)");
#endif
}

}  // namespace dinfer_bindings
