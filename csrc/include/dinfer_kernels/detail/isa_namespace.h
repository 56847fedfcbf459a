// The namespace of one instruction set's copy of the host kernels.
//
// The build compiles every host-kernel source once per ISA (generic, avx2, avx512, avx512bf16) into
// the same library, each time with that ISA's compiler flags and DINFER_ISA_NS=isa_<name>. Everything
// those sources and the headers they share define then lives in dinfer_kernels::isa_<name>, so no
// symbol of one ISA's copy can stand in for another's (an AVX-512 copy of an inline function picked
// by the linker for the generic path would crash on an AVX2 CPU). Elsewhere (bindings, CUDA sources,
// the dispatcher) DINFER_ISA_NS is undefined and these macros vanish. csrc/cpu_isa/dispatch.cpp
// chooses the copy at run time.
#pragma once

#if defined(DINFER_ISA_NS)
#define DINFER_ISA_BEGIN namespace DINFER_ISA_NS {
#define DINFER_ISA_END }
#else
#define DINFER_ISA_BEGIN
#define DINFER_ISA_END
#endif
