// The public host-kernel launchers: each forwards to the copy of the kernel compiled for the chosen
// ISA (see cpu_isa.h). Compiled for the baseline ISA, like everything outside the per-ISA sources,
// so it runs on any CPU and checks what the CPU supports before anything else executes.
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(DINFER_HOST_ISAS_X86)
#include <cpuid.h>
#endif

#include "dinfer_kernels/cpu_isa.h"
#include "kernel_families.h"

namespace dinfer_kernels {

// The launchers take their parameters by reference: declaring the structs is enough here.
#define DINFER_DECLARE_PARAMS(op, family, Params, cuda) struct Params;
DINFER_KERNEL_FAMILIES(DINFER_DECLARE_PARAMS)

// One copy of the host launchers, one per kernel family.
struct HostKernels {
#define DINFER_LAUNCHER_POINTER(op, family, Params, cuda) void (*op)(const Params&, int);
  DINFER_KERNEL_FAMILIES(DINFER_LAUNCHER_POINTER)
};

// Each ISA's copy of the launchers, defined by the host-kernel sources compiled with
// DINFER_ISA_NS=isa_<name> (csrc/include/dinfer_kernels/detail/isa_namespace.h), and its table:
// <ns>::launchers().
#define DINFER_DECLARE_LAUNCHER(op, family, Params, cuda) void op##_cpu(const Params& p, int threads);
#define DINFER_LAUNCHER(op, family, Params, cuda) op##_cpu,
#define DINFER_DECLARE_HOST_KERNELS(ns)                                                    \
  namespace ns {                                                                           \
  DINFER_KERNEL_FAMILIES(DINFER_DECLARE_LAUNCHER)                                          \
  HostKernels launchers() { return HostKernels{DINFER_KERNEL_FAMILIES(DINFER_LAUNCHER)}; } \
  }

// The copies CMakeLists.txt built (DINFER_CPU_ISAS): DINFER_HOST_ISA_<ISA> for each.
DINFER_DECLARE_HOST_KERNELS(isa_generic)
#if defined(DINFER_HOST_ISA_AVX2)
DINFER_DECLARE_HOST_KERNELS(isa_avx2)
#endif
#if defined(DINFER_HOST_ISA_AVX512)
DINFER_DECLARE_HOST_KERNELS(isa_avx512)
#endif
#if defined(DINFER_HOST_ISA_AVX512BF16)
DINFER_DECLARE_HOST_KERNELS(isa_avx512bf16)
#endif

namespace {

struct HostIsa {
  const char* name;
  bool (*supported)();
  HostKernels kernels;
  // Ops this copy runs faster than the torch reference (bench_kernels/bench_host_isa.py); "auto"
  // picks the host kernel only for these.
  std::vector<std::string> fast_ops;
};

bool always() { return true; }

#if defined(DINFER_HOST_ISAS_X86)
// XCR0 bits of the register state the OS saves on a context switch: SSE + AVX (xmm, ymm), and for
// AVX-512 also the opmask and both zmm halves. Without them the instructions fault even where cpuid
// lists them.
constexpr unsigned kYmmState = 0x6, kZmmState = 0xe6;

bool os_saves(unsigned state) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_OSXSAVE)) return false;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & state) == state;
}

// Exactly the features CMakeLists.txt compiles each copy with (DINFER_ISA_FLAGS_<isa>). maybe_unused:
// a build of fewer copies (DINFER_CPU_ISAS) asks for fewer of them.
[[maybe_unused]] bool avx2() {
  __builtin_cpu_init();
  return os_saves(kYmmState) && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
         __builtin_cpu_supports("lzcnt") && __builtin_cpu_supports("popcnt");
}
[[maybe_unused]] bool avx512() {
  return avx2() && os_saves(kZmmState) && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}
[[maybe_unused]] bool avx512bf16() { return avx512() && __builtin_cpu_supports("avx512bf16"); }
#endif

// fast_ops: bench_kernels/bench_host_isa.py --quick --threads 1 on an AMD EPYC (Zen 4) forcing each
// copy, fp32 and bf16 (reference time / ours): decode_step 3.6-24x and rope 4.1-4.8x on every copy;
// rms_norm 1.3-2.1x (generic), 1.0-1.7x (avx2), 1.5-1.8x (AVX-512); attention 0.2-0.8x without AVX2's
// register-wide paths, 1.9-4.2x after them (docs/notes/results-log.md, "Host kernels on AVX2 and SSE2 builds"),
// 1.4-11x with AVX-512. moe is listed on every copy because it wins somewhere on each (few rows per
// expert), but not everywhere: "auto" takes the dtype and shape into account through
// dinfer_kernels/_backend.py's MOE_HOST_WINS table (docs/notes/results-log.md, "auto per dtype and shape").
// Re-measure when a copy changes.
const std::vector<HostIsa>& isas() {
  static const std::vector<HostIsa> table = {
      {"generic", always, isa_generic::launchers(), {"decode_step", "moe", "rms_norm", "rope"}},
#if defined(DINFER_HOST_ISA_AVX2)
      {"avx2", avx2, isa_avx2::launchers(), {"decode_step", "attention", "moe", "rms_norm", "rope"}},
#endif
#if defined(DINFER_HOST_ISA_AVX512)
      {"avx512", avx512, isa_avx512::launchers(), {"decode_step", "attention", "moe", "rms_norm", "rope"}},
#endif
#if defined(DINFER_HOST_ISA_AVX512BF16)
      {"avx512bf16",
       avx512bf16,
       isa_avx512bf16::launchers(),
       {"decode_step", "attention", "moe", "rms_norm", "rope"}},
#endif
  };
  return table;
}

std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// The copy named `name`; `what` prefixes the error (the environment variable or the argument).
const HostIsa& find(const std::string& name, const std::string& what) {
  for (const auto& isa : isas()) {
    if (name != isa.name) continue;
    if (!isa.supported())
      throw std::invalid_argument(
          what + name + ": this CPU does not support it (supported: " + join(cpu_isas_supported()) + ")");
    return isa;
  }
  throw std::invalid_argument(what + name + ": unknown ISA (this build has: " + join(cpu_isas_built()) +
                              "; this CPU supports: " + join(cpu_isas_supported()) + ")");
}

const HostIsa& initial() {
  const char* env = std::getenv("DINFER_CPU_ISA");
  if (env != nullptr && *env != '\0' && std::string(env) != "auto") return find(env, "DINFER_CPU_ISA=");
  const HostIsa* best = &isas().front();
  for (const auto& isa : isas())
    if (isa.supported()) best = &isa;
  return *best;
}

std::atomic<const HostIsa*> g_current{nullptr};

const HostIsa& current() {
  const HostIsa* isa = g_current.load(std::memory_order_acquire);
  if (isa == nullptr) {  // first use; threads racing here all choose the same copy
    isa = &initial();
    g_current.store(isa, std::memory_order_release);
  }
  return *isa;
}

}  // namespace

std::vector<std::string> cpu_isas_built() {
  std::vector<std::string> names;
  for (const auto& isa : isas()) names.push_back(isa.name);
  return names;
}

std::vector<std::string> cpu_isas_supported() {
  std::vector<std::string> names;
  for (const auto& isa : isas())
    if (isa.supported()) names.push_back(isa.name);
  return names;
}

std::string cpu_isa() { return current().name; }

void set_cpu_isa(const std::string& isa) { g_current.store(&find(isa, "isa="), std::memory_order_release); }

std::vector<std::string> cpu_isa_fast_ops() { return current().fast_ops; }

#define DINFER_DEFINE_LAUNCHER(op, family, Params, cuda) \
  void op##_cpu(const Params& p, int threads) { current().kernels.op(p, threads); }
DINFER_KERNEL_FAMILIES(DINFER_DEFINE_LAUNCHER)

}  // namespace dinfer_kernels
