// The one list of compiled kernel families: adding a family is one line here (plus its sources).
// CMakeLists.txt reads this file for its host, CUDA and binding sources; csrc/cpu_isa/dispatch.cpp
// builds its per-ISA launcher table from it; csrc/bindings/module.cpp registers each family's bindings
// and lists its host kernel.
//
// DINFER_KERNEL_FAMILIES(X) calls X(op, family, Params, cuda) once per family, one per line in
// exactly this form (CMake parses the lines):
//   op      the public op; its launchers are dinfer_kernels::<op>_cpu (and <op>_cuda)
//   family  the folder csrc/<family>/ holding <family>_cpu.cpp (compiled once per host ISA) and, when
//           cuda is 1, <family>.cu; csrc/bindings/<family>_bindings.cpp defines register_<family>()
//   Params  the launchers' parameter struct (dinfer_kernels/<family>.h)
//   cuda    1: the family has CUDA kernels too
#pragma once

#define DINFER_KERNEL_FAMILIES(X)             \
  X(decode_step, decode, DecodeStepParams, 1) \
  X(attention, attention, AttentionParams, 1) \
  X(rms_norm, rms_norm, RmsNormParams, 0)     \
  X(rope, rope, RopeParams, 0)                \
  X(moe, moe, MoeParams, 1)
