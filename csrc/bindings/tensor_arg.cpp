#include "tensor_arg.h"

#include <algorithm>

namespace dinfer_bindings {

void throw_value_error(const std::string& msg) { throw py::value_error(msg); }
void throw_type_error(const std::string& msg) { throw py::type_error(msg); }

namespace {
std::string type_name(py::handle o) { return py::str(py::type::of(o).attr("__name__")); }

// Whether `o` is an instance of numbers.<abc> (NumPy registers its scalars there). The class is
// looked up once and kept for the process (a static py::object would be released after Python).
bool is_number_abc(py::handle o, const char* abc) {
  static py::handle integral = py::object(py::module_::import("numbers").attr("Integral")).release();
  static py::handle real = py::object(py::module_::import("numbers").attr("Real")).release();
  const int r = PyObject_IsInstance(o.ptr(), (abc[0] == 'I' ? integral : real).ptr());
  if (r < 0) PyErr_Clear();
  return r == 1;
}
}  // namespace

int64_t int_arg(py::handle o, const char* name) {
  if (PyBool_Check(o.ptr()) || !(PyLong_Check(o.ptr()) || is_number_abc(o, "Integral")))
    throw_type_error(std::string(name) + ": expected an int, got " + type_name(o));
  py::object as_int = py::reinterpret_steal<py::object>(PyNumber_Index(o.ptr()));
  if (!as_int) {
    PyErr_Clear();
    throw_type_error(std::string(name) + ": expected an int, got " + type_name(o));
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(as_int.ptr(), &overflow);
  if (overflow) throw_value_error(std::string(name) + ": out of the int64 range");
  return v;
}

int threads_arg(py::handle o, const char* name) {
  const int64_t v = int_arg(o, name);
  if (v < 0 || v > 4096) throw_value_error(std::string(name) + ": must be in [0, 4096]");
  return static_cast<int>(v);
}

void leading_strides(const TensorArg& t, int64_t* out) {
  const int last = t.ndim() - 1;
  for (int d = 0; d < last; ++d) out[d] = 0;
  if (t.numel() == 0) return;
  if (t.stride(last) != 1)
    throw_value_error(t.name() + ": the last dimension must be contiguous (stride 1), got stride " +
                      std::to_string(t.stride(last)));
  for (int d = 0; d < last; ++d) out[d] = t.size(d) == 1 ? 0 : t.stride(d);
}

dinfer_kernels::ScalarType scalar_type(DType t) {
  using dinfer_kernels::ScalarType;
  switch (t) {
    case DType::kFloat16:
      return ScalarType::kFloat16;
    case DType::kBFloat16:
      return ScalarType::kBFloat16;
    case DType::kFloat8E4M3:
      return ScalarType::kFloat8E4M3;
    default:
      return ScalarType::kFloat32;
  }
}

std::unique_ptr<TensorArg> cuda_workspace(py::handle workspace_o, size_t need, const char* query,
                                          const TensorArg& lead,
                                          std::initializer_list<const TensorArg*> arrays) {
  if (need == 0) return nullptr;
  if (workspace_o.is_none())
    throw_value_error("workspace: needs " + std::to_string(need) + " bytes (" + query + ")");
  auto workspace = std::make_unique<TensorArg>(workspace_o, "workspace");
  workspace->expect_dtype({DType::kUInt8});
  workspace->expect_contiguous();
  workspace->expect_writable();
  workspace->expect_same_device(lead);
  expect_disjoint({workspace.get()}, arrays);
  if (static_cast<size_t>(workspace->numel()) < need)
    throw_value_error("workspace: needs " + std::to_string(need) + " bytes, got " +
                      std::to_string(workspace->numel()));
  if (reinterpret_cast<uintptr_t>(workspace->data<void>()) % 16 != 0)
    throw_value_error("workspace: the data must be 16-byte aligned");
  return workspace;
}

double float_arg(py::handle o, const char* name) {
  if (PyBool_Check(o.ptr()) || !(PyFloat_Check(o.ptr()) || PyLong_Check(o.ptr()) || is_number_abc(o, "Real")))
    throw_type_error(std::string(name) + ": expected a number, got " + type_name(o));
  const double v = PyFloat_AsDouble(o.ptr());
  if (v == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw_value_error(std::string(name) + ": not representable as a double");
  }
  return v;
}

bool bool_arg(py::handle o, const char* name) {
  if (!PyBool_Check(o.ptr())) throw_type_error(std::string(name) + ": expected a bool, got " + type_name(o));
  return o.ptr() == Py_True;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat8E4M3:
      return "float8_e4m3fn";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
    case DType::kBool:
      return "bool";
    default:
      return "an unsupported dtype";
  }
}

namespace {

DType classify(const dlpack::DataType& d) {
  if (d.lanes != 1) return DType::kOther;
  if (d.code == dlpack::kFloat && d.bits == 32) return DType::kFloat32;
  if (d.code == dlpack::kFloat && d.bits == 16) return DType::kFloat16;
  if (d.code == dlpack::kBfloat && d.bits == 16) return DType::kBFloat16;
  if (d.code == dlpack::kFloat8E4M3FN && d.bits == 8) return DType::kFloat8E4M3;
  if (d.code == dlpack::kInt && d.bits == 32) return DType::kInt32;
  if (d.code == dlpack::kInt && d.bits == 64) return DType::kInt64;
  if (d.code == dlpack::kUInt && d.bits == 8) return DType::kUInt8;
  if (d.code == dlpack::kBool && d.bits == 8) return DType::kBool;
  return DType::kOther;
}

// Asks for a versioned (1.x) capsule first -- it carries the read-only flag -- then a legacy one.
py::object export_capsule(py::handle obj, bool cuda, const std::string& name) {
  py::object fn = obj.attr("__dlpack__");
  py::dict kwargs;
  if (cuda) kwargs["stream"] = -1;
  try {
    py::dict versioned = kwargs;
    versioned["max_version"] = py::make_tuple(1, 0);
    return fn(**versioned);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError)) throw_value_error(name + ": __dlpack__ failed: " + e.what());
  }
  try {
    return fn(**kwargs);
  } catch (py::error_already_set& e) { throw_value_error(name + ": __dlpack__ failed: " + e.what()); }
}

}  // namespace

TensorArg::TensorArg(py::handle obj, std::string name) : name_(std::move(name)) {
  py::object cap;
  if (PyCapsule_CheckExact(obj.ptr())) {
    // A capsule the caller exported itself (torch.utils.dlpack.to_dlpack): the cheap path for hot
    // loops, since __dlpack__ is a Python-level method in torch (a few microseconds per array).
    cap = py::reinterpret_borrow<py::object>(obj);
  } else {
    if (!py::hasattr(obj, "__dlpack__") || !py::hasattr(obj, "__dlpack_device__"))
      throw_type_error(name_ +
                       ": expected an array with __dlpack__ (torch, CuPy, NumPy) or a DLPack "
                       "capsule, got " +
                       std::string(py::str(py::type::of(obj).attr("__name__"))));
    py::tuple dev = obj.attr("__dlpack_device__")();
    const int dev_type = dev[0].cast<int>();
    if (!supported_device(dev_type)) throw_device_error(dev_type);
    cap = export_capsule(obj, dev_type != dlpack::kCPU, name_);
  }
  PyObject* c = cap.ptr();
  if (PyCapsule_IsValid(c, "dltensor_versioned")) {
    auto* m = static_cast<dlpack::ManagedTensorVersioned*>(PyCapsule_GetPointer(c, "dltensor_versioned"));
    if (m->version.major != 1) {
      // Unknown major version: the layout may differ, so it must not be read; still release it.
      if (m->deleter) m->deleter(m);
      PyCapsule_SetName(c, "used_dltensor_versioned");
      throw_value_error(name_ + ": unsupported DLPack major version " + std::to_string(m->version.major));
    }
    PyCapsule_SetName(c, "used_dltensor_versioned");
    managed_ = m;
    versioned_ = true;
    readonly_ = (m->flags & dlpack::kFlagReadOnly) != 0;
    t_ = &m->dl_tensor;
  } else if (PyCapsule_IsValid(c, "dltensor")) {
    auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
    PyCapsule_SetName(c, "used_dltensor");
    managed_ = m;
    t_ = &m->dl_tensor;
  } else {
    throw_type_error(name_ + (obj.ptr() == c
                                  ? ": not an unused DLPack capsule (each capsule can be passed once)"
                                  : ": __dlpack__ did not return a DLPack capsule"));
  }
  const int dev_type = t_->device.device_type;
  if (!supported_device(dev_type)) {
    release();  // the constructor throws: no destructor will run
    throw_device_error(dev_type);
  }
  dtype_ = classify(t_->dtype);
}

bool TensorArg::supported_device(int dev_type) {
  return dev_type == dlpack::kCPU || dev_type == dlpack::kCUDA || dev_type == dlpack::kCUDAManaged;
}

void TensorArg::throw_device_error(int dev_type) const {
  throw_value_error(name_ + ": unsupported device type " + std::to_string(dev_type) +
                    " (expected CPU or CUDA)");
}

TensorArg::~TensorArg() { release(); }

void TensorArg::release() {
  // We own the managed tensor once the capsule is renamed "used_*": release the producer's view.
  if (versioned_) {
    auto* m = static_cast<dlpack::ManagedTensorVersioned*>(managed_);
    if (m && m->deleter) m->deleter(m);
  } else {
    auto* m = static_cast<dlpack::ManagedTensor*>(managed_);
    if (m && m->deleter) m->deleter(m);
  }
  managed_ = nullptr;
}

int64_t TensorArg::stride(int d) const {
  if (t_->strides) return t_->strides[d];
  int64_t s = 1;
  for (int i = t_->ndim - 1; i > d; --i) s *= t_->shape[i];
  return s;
}

int64_t TensorArg::numel() const {
  int64_t n = 1;
  for (int i = 0; i < t_->ndim; ++i) n *= t_->shape[i];
  return n;
}

// The messages are built with std::string and std::to_string, not iostreams: on the GPU image a
// ValueError whose text went through an ostringstream's number formatting crashed the process
// (SIGSEGV inside the binding; the same call raised cleanly on the CPU build machine).
void TensorArg::expect_dtype(std::initializer_list<DType> allowed) const {
  for (DType a : allowed)
    if (a == dtype_) return;
  std::string msg = name_ + ": expected dtype ";
  bool first = true;
  for (DType a : allowed) {
    msg += std::string(first ? "" : " or ") + dtype_name(a);
    first = false;
  }
  throw_type_error(msg + ", got " + dtype_name(dtype_));
}

void TensorArg::expect_shape(std::initializer_list<int64_t> dims) const {
  bool ok = static_cast<int>(dims.size()) == t_->ndim;
  int i = 0;
  for (int64_t d : dims) {
    if (ok && d >= 0 && t_->shape[i] != d) ok = false;
    ++i;
  }
  if (ok) return;
  std::string msg = name_ + ": expected shape [";
  i = 0;
  for (int64_t d : dims) msg += (i++ ? ", " : "") + (d >= 0 ? std::to_string(d) : std::string("*"));
  msg += "], got [";
  for (int j = 0; j < t_->ndim; ++j) msg += (j ? ", " : "") + std::to_string(t_->shape[j]);
  throw_value_error(msg + "]");
}

void TensorArg::expect_contiguous() const {
  if (numel() == 0) return;  // strides of empty arrays carry no layout
  int64_t expect = 1;
  for (int d = t_->ndim - 1; d >= 0; --d) {
    if (t_->shape[d] != 1 && stride(d) != expect)
      throw_value_error(name_ + ": expected a contiguous array (stride of dim " + std::to_string(d) + " is " +
                        std::to_string(stride(d)) + ", expected " + std::to_string(expect) + ")");
    expect *= t_->shape[d];
  }
}

void TensorArg::expect_writable() const {
  if (readonly_) throw_value_error(name_ + ": the array is read-only but is written in place");
}

void TensorArg::expect_same_device(const TensorArg& other) const {
  if (t_->device.device_type != other.t_->device.device_type ||
      t_->device.device_id != other.t_->device.device_id)
    throw_value_error(name_ + ": must be on the same device as " + other.name_);
}

int64_t TensorArg::elem_bytes() const { return (t_->dtype.bits * t_->dtype.lanes + 7) / 8; }

uintptr_t TensorArg::byte_lo() const {
  int64_t lo = 0;
  if (numel() > 0)
    for (int d = 0; d < ndim(); ++d) lo += std::min<int64_t>(0, (size(d) - 1) * stride(d));
  return reinterpret_cast<uintptr_t>(data<char>()) + lo * elem_bytes();
}

uintptr_t TensorArg::byte_hi() const {
  if (numel() == 0) return byte_lo();
  int64_t hi = 0;
  for (int d = 0; d < ndim(); ++d) hi += std::max<int64_t>(0, (size(d) - 1) * stride(d));
  return reinterpret_cast<uintptr_t>(data<char>()) + (hi + 1) * elem_bytes();
}

bool TensorArg::same_view(const TensorArg& other) const {
  if (data<char>() != other.data<char>() || ndim() != other.ndim() ||
      t_->dtype.code != other.t_->dtype.code || t_->dtype.bits != other.t_->dtype.bits ||
      t_->dtype.lanes != other.t_->dtype.lanes)
    return false;
  for (int d = 0; d < ndim(); ++d)
    if (size(d) != other.size(d) || (size(d) > 1 && stride(d) != other.stride(d))) return false;
  return true;
}

namespace {

bool overlaps(const TensorArg& a, const TensorArg& b) {
  if (a.on_cuda() != b.on_cuda() || a.device_id() != b.device_id()) return false;  // other memories
  return a.byte_lo() < b.byte_hi() && b.byte_lo() < a.byte_hi();
}

void check_pair(const TensorArg& w, const TensorArg& r, std::initializer_list<InPlace> inplace) {
  if (&w == &r || !overlaps(w, r)) return;
  bool allowed = false;
  for (const InPlace& ip : inplace)
    allowed = allowed || (ip.written == &w && ip.read == &r) || (ip.written == &r && ip.read == &w);
  if (allowed && w.same_view(r)) return;
  throw_value_error(w.name() + ": overlaps " + r.name() + " in memory" +
                    (allowed ? " without being exactly the same view (in place: pass " + r.name() + " itself)"
                             : " (the op reads and writes them in parallel: use separate arrays)"));
}

}  // namespace

void expect_disjoint(std::initializer_list<const TensorArg*> written,
                     std::initializer_list<const TensorArg*> read, std::initializer_list<InPlace> inplace) {
  for (auto w = written.begin(); w != written.end(); ++w) {
    if (!*w) continue;
    for (auto w2 = w + 1; w2 != written.end(); ++w2)
      if (*w2) check_pair(**w, **w2, inplace);
    for (const TensorArg* r : read)
      if (r) check_pair(**w, *r, inplace);
  }
}

std::unique_ptr<TensorArg> optional_arg(py::handle obj, const char* name) {
  return obj.is_none() ? nullptr : std::make_unique<TensorArg>(obj, name);
}

void expect_arrays(const TensorArg& lead, std::initializer_list<ArrayExpect> table) {
  for (const ArrayExpect& e : table) {
    if (e.array == nullptr) continue;
    if (e.dtypes.size()) e.array->expect_dtype(e.dtypes);
    if (e.shape.size()) e.array->expect_shape(e.shape);
    if (e.flags & kContiguous) e.array->expect_contiguous();
    if (e.flags & kWritable) e.array->expect_writable();
  }
  for (const ArrayExpect& e : table)
    if (e.array != nullptr && e.array != &lead) e.array->expect_same_device(lead);
}

}  // namespace dinfer_bindings
