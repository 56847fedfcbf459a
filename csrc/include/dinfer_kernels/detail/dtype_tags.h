// The element formats the kernels are instantiated for, as tag types (a kernel template takes the tag;
// overloads on it pick the conversion or the tensor-core instruction), and the exact conversions of
// their elements to and from fp32 with torch's rounding (scalar.h). One set for the host and device
// code of every family.
#pragma once

#include <cstdint>

#include "dinfer_kernels/detail/isa_namespace.h"
#include "dinfer_kernels/detail/scalar.h"
#include "dinfer_kernels/types.h"

namespace dinfer_kernels {
DINFER_ISA_BEGIN
namespace dtype {

// Raw: how an element is stored; kVec: elements per 16-byte vector.
struct F32Tag {
  using Raw = float;
  static constexpr int kVec = 4;
};
struct BF16Tag {
  using Raw = uint16_t;
  static constexpr int kVec = 8;
};
struct F16Tag {
  using Raw = uint16_t;
  static constexpr int kVec = 8;
};

// Exact: every bf16 / fp16 value, subnormals included, is an fp32 value.
DINFER_HD float to_float(float x, F32Tag) { return x; }
DINFER_HD float to_float(uint16_t x, BF16Tag) { return scalar::bf16_to_float(x); }
DINFER_HD float to_float(uint16_t x, F16Tag) { return scalar::fp16_to_float(x); }

// Round to nearest even.
DINFER_HD float from_float(float x, F32Tag) { return x; }
DINFER_HD uint16_t from_float(float x, BF16Tag) { return scalar::float_to_bf16(x); }
DINFER_HD uint16_t from_float(float x, F16Tag) { return scalar::float_to_fp16(x); }

// The value x has once stored in the format (the references round their GEMM outputs so).
template <class Tag>
DINFER_HD float round_to(float x) {
  return to_float(from_float(x, Tag{}), Tag{});
}

// Element i of an array whose format is known at run time only, as fp32 (exact).
DINFER_HD float load_float(const void* p, ScalarType t, int64_t i) {
  if (t == ScalarType::kFloat32) return static_cast<const float*>(p)[i];
  if (t == ScalarType::kBFloat16) return scalar::bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  return scalar::fp16_to_float(static_cast<const uint16_t*>(p)[i]);
}

}  // namespace dtype
DINFER_ISA_END
}  // namespace dinfer_kernels
