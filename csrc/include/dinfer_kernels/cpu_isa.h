// Which instruction set the host kernels run with.
//
// The host kernels (decode_step_cpu, attention_cpu, moe_cpu, rms_norm_cpu, rope_cpu) are compiled
// once per ISA into the library: "generic" (the x86-64 baseline; the only one off x86-64), "avx2"
// (AVX2, FMA, F16C, BMI1/2, LZCNT, POPCNT), "avx512" (AVX-512 F/BW/DQ/VL and the avx2 set) and
// "avx512bf16" (+ AVX512-BF16). The public launchers forward to one copy, chosen at first use: the
// best this CPU runs (cpuid, and for AVX/AVX-512 the OS's saving of their registers, xgetbv), or the
// one the environment variable DINFER_CPU_ISA names (generic | avx2 | avx512 | avx512bf16 | auto),
// which may lower the choice but never raise it past what the CPU runs.
#pragma once

#include <string>
#include <vector>

namespace dinfer_kernels {

// The ISAs this build has host kernels for, lowest first.
std::vector<std::string> cpu_isas_built();

// Those of them this CPU runs, lowest first.
std::vector<std::string> cpu_isas_supported();

// The ISA the launchers use. Throws std::invalid_argument, naming DINFER_CPU_ISA and the supported
// ISAs, when the variable names an unknown ISA or one this CPU does not run.
std::string cpu_isa();

// Switches every later host-kernel call to `isa`'s copy. Process-global (for tests and benchmarks):
// not while another thread is inside a host kernel. Throws std::invalid_argument for an unknown name
// or one this CPU does not run.
void set_cpu_isa(const std::string& isa);

// The ops whose copy for the ISA in use was measured faster than the op's torch reference; where an
// op is missing, "auto" keeps the host on torch (dinfer_kernels/_backend.py).
std::vector<std::string> cpu_isa_fast_ops();

}  // namespace dinfer_kernels
