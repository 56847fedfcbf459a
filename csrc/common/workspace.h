// The device workspace of the CUDA launchers: each launcher lays its arrays out from offset 0, every
// one on a 256-byte boundary, and takes the workspace only 16-byte aligned (its vector accesses).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dinfer_kernels {
namespace workspace {

constexpr size_t kAlign = 256;

constexpr size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace workspace
}  // namespace dinfer_kernels
