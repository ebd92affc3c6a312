// Chooses the kernels for this CPU at run time, so the wheel needs no -march flags.
#include <cstdlib>
#include <cstring>
#include <string>

#include "cpu/kernel_table.h"

namespace jax_flash {
namespace cpu {
namespace {

bool CpuHasAvx512() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool CpuHasAvx512Bf16() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return CpuHasAvx512() && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool CpuHasAvx2() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

}  // namespace

const KernelTable* SelectKernels(std::string* error) {
  const char* requested = std::getenv("JAX_FLASH_CPU_ISA");
  const bool any = requested == nullptr || *requested == '\0';
#if defined(__x86_64__) || defined(_M_X64)
  if (any || std::strcmp(requested, "avx512bf16") == 0) {
    if (CpuHasAvx512Bf16()) return &avx512bf16::Kernels();
    if (!any) {
      *error = "JAX_FLASH_CPU_ISA=avx512bf16 but this CPU lacks AVX-512 (F, VL, BW, DQ) with BF16";
      return nullptr;
    }
  }
  if (any || std::strcmp(requested, "avx512") == 0) {
    if (CpuHasAvx512()) return &avx512::Kernels();
    if (!any) {
      *error = "JAX_FLASH_CPU_ISA=avx512 but this CPU lacks AVX-512 (F, VL, BW, DQ)";
      return nullptr;
    }
  }
  if (any || std::strcmp(requested, "avx2") == 0) {
    if (CpuHasAvx2()) return &avx2::Kernels();
    if (!any) {
      *error = "JAX_FLASH_CPU_ISA=avx2 but this CPU lacks AVX2 and FMA";
      return nullptr;
    }
  }
#endif
  if (any || std::strcmp(requested, "generic") == 0) return &generic::Kernels();
  *error = std::string("JAX_FLASH_CPU_ISA=") + requested +
           " is not one of: avx512bf16, avx512, avx2, generic (or unset for the best this CPU runs)";
  return nullptr;
}

}  // namespace cpu
}  // namespace jax_flash
