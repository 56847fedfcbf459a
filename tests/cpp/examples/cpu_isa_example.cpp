// A C++ runtime asking which ISA the host kernels run with: prints the one in use and the ones this
// CPU supports; exits 2 with the library's message when DINFER_CPU_ISA names one it cannot use.
#include <cstdio>
#include <stdexcept>
#include <string>

#include "dinfer_kernels/cpu_isa.h"

int main() {
  try {
    std::string supported;
    for (const auto& isa : dinfer_kernels::cpu_isas_supported()) supported += " " + isa;
    std::printf("%s:%s\n", dinfer_kernels::cpu_isa().c_str(), supported.c_str());
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
